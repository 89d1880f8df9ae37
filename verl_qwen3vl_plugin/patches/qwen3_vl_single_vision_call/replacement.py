"""verl's Qwen3-VL(-MoE) and Qwen3.5(-MoE) input embeddings with one vision-tower call per micro-batch, whatever it
holds.

Why: verl's ``_get_input_embeds`` calls the tower once for the images and once more for the videos. Under FSDP each
tower call is a collective (its blocks' all-gathers), so a rank whose micro-batch mixes images and videos makes two
calls while its peers make one: NCCL hangs or exchanges wrong data, gloo fails on a size mismatch.
How: images and videos go through the tower together, patches and grid rows concatenated (images first); the tower
treats every grid row on its own, so each row's output is the one a separate call gives, up to fp rounding of the
batched matmuls. The merged embeddings are split back at the image/video boundary and scattered as verl does; the
deepstack features (Qwen3-VL's; Qwen3.5 has none) are reordered into sequence order with one index_select. A
text-only micro-batch still runs verl's one dummy image. Host syncs: one (the token counts, with the image share),
never more than verl's. The plugin installs them through ``naming_strays``: a token-count error that a sampled
placeholder causes names it (``vision_placeholder_ban``'s check, which verl's own function does not make).
When it applies, and when it can be removed: the ``qwen3_vl_single_vision_call`` spec.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from verl_qwen3vl_plugin.patches.qwen3_vl_vision_dp.replacement import split_output
from verl_qwen3vl_plugin.patches.vision_placeholder_ban.replacement import refuse_strays

DUMMY_GRID = [1, 4, 4]  # verl's dummy image for a text-only micro-batch


def _sequence_order(image_mask: torch.Tensor, video_mask: torch.Tensor, images: int, visual: int) -> torch.Tensor:
    """For each visual token in sequence order, its row in [image rows; video rows]. No host sync: ``visual``
    (the number of visual tokens) is known on the host."""
    image_flat, video_flat = image_mask.flatten(), video_mask.flatten()
    row = torch.where(image_flat, image_flat.cumsum(0) - 1, video_flat.cumsum(0) - 1 + images)
    is_visual = image_flat | video_flat
    slot = torch.where(is_visual, is_visual.cumsum(0) - 1, visual)  # non-visual tokens land in a spare slot
    return row.new_zeros(visual + 1).scatter_(0, slot, row)[:visual]


def _check_counts(kind: str, tokens: int, features: int) -> None:
    """verl's token-count error."""
    if tokens != features:
        raise ValueError(
            f"{kind.capitalize()} features and {kind} tokens do not match: tokens: {tokens}, features {features}"
        )


def get_input_embeds(
    model: nn.Module,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None = None,
    pixel_values: torch.FloatTensor | None = None,
    pixel_values_videos: torch.FloatTensor | None = None,
    image_grid_thw: torch.LongTensor | None = None,
    video_grid_thw: torch.LongTensor | None = None,
) -> dict[str, torch.Tensor | list[torch.Tensor] | None]:
    """Qwen3-VL's language-model inputs for a micro-batch (embeddings, attention mask, visual position mask,
    deepstack features) with exactly one ``model.visual`` call, whatever it holds: a call per modality would make a
    different number of FSDP collectives on ranks holding different media. The token-count errors are verl's."""
    inputs_embeds = model.get_input_embeddings()(input_ids)
    config, visual = model.config, model.visual
    media = [
        (kind, pixels, grid, input_ids == token)
        for kind, pixels, grid, token in (
            ("image", pixel_values, image_grid_thw, config.image_token_id),
            ("video", pixel_values_videos, video_grid_thw, config.video_token_id),
        )
        if pixels is not None
    ]
    visual_pos_masks, deepstack = None, None
    if not media:  # verl's dummy image: the tower (and its collectives) runs on every micro-batch
        vision = config.vision_config
        patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        pixels = torch.zeros(16, patch_dim, dtype=inputs_embeds.dtype, device=inputs_embeds.device)
        grid = torch.tensor([DUMMY_GRID], dtype=torch.long, device=inputs_embeds.device)
        embeds, dummy_deepstack = split_output(visual(pixels, grid_thw=grid))
        inputs_embeds = inputs_embeds + 0.0 * embeds.mean()
        for feature in dummy_deepstack:
            inputs_embeds = inputs_embeds + 0.0 * feature.mean()
    else:
        pixels = torch.cat([m[1].type(visual.dtype) for m in media])
        grid = torch.cat([m[2] for m in media])
        embeds, deepstack = split_output(visual(pixels, grid_thw=grid))
        counts = [m[3].sum() for m in media]
        if len(media) == 2:  # where the image rows end: the images' merged patch count
            counts.append(media[0][2].prod(-1).sum() // visual.spatial_merge_size**2)
        tokens = torch.stack(counts).tolist()  # the one host sync
        features = [tokens[2], embeds.shape[0] - tokens[2]] if len(media) == 2 else [embeds.shape[0]]
        for (kind, *_), n_tokens, n_features in zip(media, tokens, features, strict=False):
            _check_counts(kind, n_tokens, n_features)
        for (_, _, _, mask), part in zip(media, embeds.split(features), strict=True):
            part = part.to(inputs_embeds.device, inputs_embeds.dtype)
            inputs_embeds = inputs_embeds.masked_scatter(mask.unsqueeze(-1).expand_as(inputs_embeds), part)
        if len(media) == 1:
            visual_pos_masks = media[0][3]
        else:
            image_mask, video_mask = media[0][3], media[1][3]
            visual_pos_masks = image_mask | video_mask
            if deepstack:
                order = _sequence_order(image_mask, video_mask, features[0], embeds.shape[0]).to(embeds.device)
                deepstack = [feature.index_select(0, order) for feature in deepstack]
    if attention_mask is not None:
        attention_mask = attention_mask.to(inputs_embeds.device)
    return {
        "inputs_embeds": inputs_embeds,
        "attention_mask": attention_mask,
        "visual_pos_masks": visual_pos_masks,
        "deepstack_visual_embeds": deepstack,
    }


def naming_strays(get_embeds: Callable) -> Callable:
    """``get_embeds`` (either contract) whose token-count error also names the sampled placeholder behind it, where
    one is (``refuse_strays``). Looked for only on that error: the good path keeps its one host sync."""

    @functools.wraps(get_embeds)
    def wrapper(model: nn.Module, input_ids: torch.LongTensor, *args: Any, **kwargs: Any):
        try:
            return get_embeds(model, input_ids, *args, **kwargs)
        except ValueError as mismatch:
            kinds = [k for k in ("image", "video") if str(mismatch).startswith(f"{k.capitalize()} features and")]
            if not kinds:
                raise
            try:
                refuse_strays(input_ids, model.config, kinds)
            except ValueError as stray:
                raise ValueError(f"{mismatch}. {stray}") from None
            raise

    return wrapper


def get_input_embeds_qwen3_5(*args: Any, **kwargs: Any) -> dict[str, torch.Tensor | None]:
    """Qwen3.5's language-model inputs (embeddings, attention mask): Qwen3-VL's, with its one tower call (Qwen3.5's
    tower has no deepstack features)."""
    out = get_input_embeds(*args, **kwargs)
    return {"inputs_embeds": out["inputs_embeds"], "attention_mask": out["attention_mask"]}
