"""The rollout never samples a vision placeholder, and a sequence that holds one anyway fails at once by name.

``<|image_pad|>`` and ``<|video_pad|>`` are ordinary vocabulary entries. Once sampled, every later pass that pairs
placeholders with vision features dies on the count (transformers' ``get_rope_index``, ``masked_scatter_``, verl's
``_get_input_embeds``), often hours into a run. verl 0.9's vLLM rollout sets their logits to -inf; on verl 0.7 / 0.8
``ban_placeholders`` does the same around verl's own ``compute_logits`` patch, in the process where verl patches
vLLM's model. ``refuse_strays`` guards where verl first pairs a sequence (its agent loop's position ids, and the
trainer's ``_get_input_embeds``, which ``qwen3_vl_single_vision_call`` replaces, on its token-count error): whatever
engine sampled it, the error names the sample, the token and the fix.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from types import MethodType, SimpleNamespace

import torch

PLACEHOLDER_FIELDS = ("image_token_id", "video_token_id")
TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
}
FIX = (
    "ban the vision placeholder ids in the rollout's sampling: verl >= 0.9's vLLM rollout does, and this plugin does "
    "for verl 0.7 / 0.8's; for another engine give them a logit bias of -inf (SGLang's and vLLM's logit_bias)"
)


def placeholder_ids(config) -> list[int]:
    """The served model's image and video placeholder ids; none for a text-only model."""
    return sorted({getattr(config, f) for f in PLACEHOLDER_FIELDS if isinstance(getattr(config, f, None), int)})


def ban_placeholders(original: Callable) -> Callable:
    """verl's ``monkey_patch_compute_logits(model, vocab_size)``, then the served model's placeholders at -inf."""

    @functools.wraps(original)
    def wrapper(model, *args, **kwargs):
        original(model, *args, **kwargs)
        banned = placeholder_ids(getattr(model, "config", None))
        if not banned:
            return  # text-only: verl's own patch alone, bit for bit
        patched = model.compute_logits
        index = torch.tensor(banned, dtype=torch.long)

        def compute_logits(self, *inner, **inner_kwargs):
            nonlocal index
            logits = patched(*inner, **inner_kwargs)  # verl's own patch has written into them: never None here
            if index.device != logits.device:
                index = index.to(logits.device)
            return logits.index_fill_(-1, index, float("-inf"))

        model.compute_logits = MethodType(compute_logits, model)

    return wrapper


def first_stray(input_ids: torch.Tensor, placeholders: Iterable[int], vision_start: int) -> tuple[int, int, int] | None:
    """(row, position, id) of the first placeholder whose run does not open right after ``vision_start``: one no
    image or video stands behind. None when there is none."""
    ids = input_ids if input_ids.dim() == 2 else input_ids.unsqueeze(0)
    placeholders = torch.tensor(sorted(placeholders), dtype=ids.dtype, device=ids.device)
    previous = torch.nn.functional.pad(ids[:, :-1], (1, 0), value=-1)
    opens = torch.isin(ids, placeholders) & (previous != ids)
    stray = opens & (previous != vision_start)
    if not stray.any():
        return None
    row, position = (int(i) for i in stray.nonzero()[0])
    return row, position, int(ids[row, position])


def refuse_strays(
    input_ids: torch.Tensor, config, kinds: Iterable[str] = ("image", "video"), what: str = "row {row}", decode=None
) -> None:
    """A ValueError naming the first placeholder of ``kinds`` in ``input_ids`` that no image or video stands behind;
    ``config`` holds the ids (a model config, or ``processor_ids``), ``decode`` (a tokenizer's) quotes the text
    around it."""
    vision_start = getattr(config, "vision_start_token_id", None)
    tokens = {getattr(config, f"{kind}_token_id", None): kind for kind in kinds}
    tokens.pop(None, None)
    if vision_start is None or not tokens:
        return
    found = first_stray(input_ids, tokens, vision_start)
    if found is not None:
        row, position, token = found
        kind = tokens[token]
        quoted = ""
        if decode is not None:
            ids = input_ids if input_ids.dim() == 2 else input_ids.unsqueeze(0)
            quoted = f" (the text up to it: {decode(ids[row, max(0, position - 12) : position + 1].tolist())!r})"
        raise ValueError(
            f"{what.format(row=row)} holds the {kind} placeholder token {token} at position {position}{quoted}, with "
            f"no {kind} behind it: the rollout engine sampled it, and no vision pass can pair it. Fix: {FIX}"
        )


def refuse_strays_in_positions(original: Callable) -> Callable:
    """verl's agent loop ``_compute_position_ids(self, input_ids, ...)``: each sample's first pairing, where
    transformers >= 5's ``get_rope_index`` would raise ``StopIteration`` or ``TypeError``."""

    @functools.wraps(original)
    def wrapper(self, input_ids, *args, **kwargs):
        processor = getattr(self, "processor", None)
        if processor is not None:
            decode = getattr(getattr(processor, "tokenizer", None), "decode", None)
            refuse_strays(input_ids, processor_ids(processor), what="a sample of verl's agent loop", decode=decode)
        return original(self, input_ids, *args, **kwargs)

    return wrapper


def processor_ids(processor) -> SimpleNamespace:
    """The placeholder and vision-start ids from the processor's tokenizer; None where it lacks the token, and all
    None for a processor without a tokenizer (verl's own tests pass such stand-ins: nothing is read from them)."""
    tokenizer = getattr(processor, "tokenizer", None)
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    unknown = getattr(tokenizer, "unk_token_id", None)
    ids = {field: convert(token) if callable(convert) else None for field, token in TOKENS.items()}
    return SimpleNamespace(**{k: v if isinstance(v, int) and v != unknown else None for k, v in ids.items()})
