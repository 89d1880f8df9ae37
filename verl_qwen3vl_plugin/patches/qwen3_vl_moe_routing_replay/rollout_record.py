"""Whether the rollout's routing record fits its batch, before R3 replays it.

vLLM returns one row per token it ran: every token of a sample but the last, which it sampled and never ran. verl's
agent loop writes those rows from the sample's first real token into zeros, so a row of no route reads as "expert 0
k times". Two things break that silently, and verl checks neither:

- a shift: vLLM expanded an image or video into another number of placeholder tokens than the HF processor did
  (``min_pixels`` / ``max_pixels`` or video timestamps differing between the two), so every later row belongs to
  another token. Replaying it routes every later token as some other token was routed. That is an error, naming the
  sample;
- rows with no route inside a sample: the engine skipped its router hook. Those pairs fall back to the model's own
  routing (``routes.Routes.choose``); their share is a metric, and past a threshold an error naming the known causes.

A multi-turn sample may end in tokens after its final generation (tool output, outside the loss) with no rows: that
is allowed, a missing row on a token the loss uses is not.
"""

from __future__ import annotations

import os

import torch

from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay.routes import ReplayError, has_route

MAX_FALLBACK_ENV = "VERL_QWEN3VL_PLUGIN_R3_MAX_FALLBACK"
DEFAULT_MAX_FALLBACK = 0.01
KNOWN_CAUSES = (
    "vLLM 0.22 to 0.26 with monolithic MoE kernels (Blackwell) skip the router hook (vLLM #44116, #54730); "
    "vllm-ascend 0.26.0rc1 skips the capture on a config assertion (vllm-ascend #16314)"
)
SHIFT_CAUSE = (
    "the rollout engine expanded an image or video into another number of placeholder tokens than the HF processor "
    "did: give vLLM and the processor the same min_pixels / max_pixels (and video settings)"
)


def max_fallback() -> float:
    """The largest share of routeless (token, MoE layer) pairs a step may replay (``MAX_FALLBACK_ENV``)."""
    raw = os.environ.get(MAX_FALLBACK_ENV, "")
    try:
        value = float(raw) if raw.strip() else DEFAULT_MAX_FALLBACK
    except ValueError:
        raise ReplayError(f"{MAX_FALLBACK_ENV}={raw!r}: give a fraction between 0 and 1") from None
    if not 0.0 <= value <= 1.0:
        raise ReplayError(f"{MAX_FALLBACK_ENV}={raw!r}: give a fraction between 0 and 1")
    return value


def check(
    routed: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor | None,
    top_k: int,
    last_may_route: torch.Tensor,
) -> float | None:
    """Raise a ReplayError where the record does not fit its samples; else the share of the (token, layer) pairs the
    rollout ran that have no route. ``routed``: (bsz, seqlen, layers), True where a pair has a route, in the batch's
    padded layout; ``loss_mask``: (bsz, seqlen), or None where the batch does not say which tokens the loss uses;
    ``last_may_route``: (bsz,) samples whose last token may have a route: verl cuts a multi-turn response that ran
    past ``response_length``, and its record with it, so the record covers every token left. None for top_k 1,
    where a row of no route cannot be told from a route to expert 0."""
    if top_k < 2:
        return None
    real = attention_mask.bool()
    bsz, seqlen, layers = routed.shape
    positions = torch.arange(seqlen, device=real.device).expand(bsz, -1)
    first = real.int().argmax(-1)
    last = seqlen - 1 - real.flip(-1).int().argmax(-1)  # each sample's last token: the one the engine never ran
    end = last + last_may_route.to(last.device).long()
    row = routed.any(-1)
    beyond = row & ~(real & (positions < end[:, None]))
    if beyond.any():
        sample, position = (int(i) for i in beyond.nonzero()[0])
        token, count = position - int(first[sample]), int(real[sample].sum())
        where = f"{-token} rows before its first token" if token < 0 else f"on token {token} of its {count}"
        raise ReplayError(
            f"the rollout's routing record does not fit sample {sample}: it has a route {where}, but the engine ran "
            f"only the sample's first {count - 1} tokens (every token but the last). The record is shifted: "
            f"{SHIFT_CAUSE}"
        )
    has_any = row.any(-1)
    samples = torch.arange(bsz, device=real.device)
    # vLLM records a sample's first token; a record moved later loses it, where verl's cut hides the last token
    late = has_any & ~row[samples, first] & row[samples, last]
    if late.any():
        sample = int(late.nonzero()[0])
        raise ReplayError(
            f"the rollout's routing record does not fit sample {sample}: it has no route on the sample's first token "
            f"but one on its last, so its rows are moved later. The record is shifted: {SHIFT_CAUSE}"
        )
    last_routed = torch.where(row, positions, -1).amax(-1)
    if loss_mask is not None:
        loss = loss_mask.bool()
        short = has_any[:, None] & loss & (positions > last_routed[:, None] + 1)
        if short.any():
            sample, position = (int(i) for i in short.nonzero()[0])
            raise ReplayError(
                f"the rollout's routing record does not fit sample {sample}: the loss uses its token "
                f"{position - int(first[sample])}, but the record's routes end at token "
                f"{int(last_routed[sample]) - int(first[sample])}. The record is shifted: {SHIFT_CAUSE}"
            )
        # verl 0.9's filler samples (a batch padded to a multiple of the ranks): no route, no loss, never run
        counted = has_any | loss.any(-1)
    else:
        counted = torch.ones_like(has_any)
    ran_to = torch.where(has_any, last_routed + 1, last)  # a sample with no route at all: every token it ran
    expected = real & (positions < ran_to[:, None]) & counted[:, None]
    pairs = int(expected.sum()) * layers
    if not pairs:
        return 0.0
    fallback = int((expected[..., None] & ~routed).sum()) / pairs
    limit = max_fallback()
    if fallback > limit:
        raise ReplayError(
            f"{fallback:.1%} of the (token, MoE layer) pairs the rollout ran have no route in its record, above the "
            f"{limit:.1%} limit ({MAX_FALLBACK_ENV}); those would be routed by the trainer's own router, not the "
            f"rollout's. Known causes: {KNOWN_CAUSES}"
        )
    return fallback


def window_filled(attention_mask: torch.Tensor) -> torch.Tensor:
    """(bsz,) samples whose response fills verl's padded response window: the ones verl may have cut."""
    return attention_mask[:, -1].bool()


def padded_routed(record: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The nested record's (token, layer) route flags back in the batch's padded layout (verl's
    ``left_right_2_no_padding`` takes a sample's real tokens in order)."""
    values = has_route(record.values())
    out = values.new_zeros(*attention_mask.shape, values.shape[-1])
    out[attention_mask.bool()] = values
    return out


def full_loss_mask(response_mask: torch.Tensor | None, seqlen: int) -> torch.Tensor | None:
    """verl's ``response_mask`` (bsz, response) on the whole sequence: responses are its last columns."""
    if response_mask is None:
        return None
    full = response_mask.new_zeros(response_mask.shape[0], seqlen)
    full[:, seqlen - response_mask.shape[1] :] = response_mask
    return full


def nested_loss_mask(loss_mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A nested per-response ``loss_mask`` (verl 0.9's TransferQueue path: each sample's response tokens) on rows of
    ``lengths`` tokens laid out from column 0: each response is its row's last tokens."""
    responses = loss_mask.offsets().diff().to(lengths.device)
    width = int(lengths.max()) if lengths.numel() else 0
    columns = torch.arange(width, device=lengths.device)
    start = lengths - responses
    inside = (columns >= start[:, None]) & (columns < lengths[:, None])
    full = torch.zeros(len(lengths), width, dtype=loss_mask.values().dtype, device=lengths.device)
    full[inside] = loss_mask.values().to(lengths.device)
    return full
