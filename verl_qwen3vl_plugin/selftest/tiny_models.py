"""Tiny random Qwen3-VL and Qwen3-VL-MoE models built from configs: no hub download, a few hundred kB each."""

from __future__ import annotations

import torch
from transformers import (
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

IMAGE_TOKEN, VIDEO_TOKEN, VISION_START = 100, 101, 102
VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=32,
    num_position_embeddings=64,  # an 8 x 8 table: interpolation actually interpolates
    deepstack_visual_indexes=[0],
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
)
TEXT = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
)
# hidden 32 != 2 * moe_intermediate: a mix-up of the experts' two projections cannot pass as a correct shape.
MOE_TEXT = dict(TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1)
TOKENS = dict(image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START)


def vision_tower(hidden: int = 32, table: int = 2304, dtype: torch.dtype = torch.float32) -> Qwen3VLVisionModel:
    """A one-block vision tower whose position table is 48 x 48 like Qwen3-VL's, with seeded random entries."""
    config = Qwen3VLVisionConfig(
        depth=1, hidden_size=hidden, intermediate_size=16, num_heads=1, out_hidden_size=hidden,
        num_position_embeddings=table, deepstack_visual_indexes=[],
    )  # fmt: skip
    tower = Qwen3VLVisionModel(config)
    with torch.no_grad():
        tower.pos_embed.weight.normal_(generator=torch.Generator().manual_seed(0))
    return tower.to(dtype)


def randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Modules built from a config may hold uninitialised memory: give every parameter seeded values."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    return module


def tiny_qwen3_vl(seed: int = 0, **vision) -> Qwen3VLForConditionalGeneration:
    """``vision`` overrides VISION (e.g. a deeper, wider tower for a benchmark)."""
    torch.manual_seed(seed)
    config = Qwen3VLConfig(text_config=TEXT, vision_config={**VISION, **vision}, **TOKENS)
    return Qwen3VLForConditionalGeneration(config).eval()


def tiny_qwen3_vl_moe_config(vision: dict | None = None, **text: int) -> Qwen3VLMoeConfig:
    """``text`` overrides MOE_TEXT (e.g. ``moe_intermediate_size=16``: hidden == 2 * intermediate), ``vision``
    overrides VISION."""
    return Qwen3VLMoeConfig(text_config={**MOE_TEXT, **text}, vision_config={**VISION, **(vision or {})}, **TOKENS)


def tiny_qwen3_vl_moe(seed: int = 0, vision: dict | None = None, **text: int) -> Qwen3VLMoeForConditionalGeneration:
    torch.manual_seed(seed)
    return Qwen3VLMoeForConditionalGeneration(tiny_qwen3_vl_moe_config(vision, **text)).eval()


def pixel_values(grid_thw: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Random flattened patches for ``grid_thw`` in the vision tower's input layout."""
    patch_dim = 3 * VISION["temporal_patch_size"] * VISION["patch_size"] ** 2
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(int(grid_thw.prod(-1).sum()), patch_dim, generator=generator)


def image_prompt(grid_thw: torch.Tensor, text: int = 6) -> torch.Tensor:
    """Token ids with one vision segment per image (merged patch count of image tokens each) and some text."""
    merge = VISION["spatial_merge_size"] ** 2
    ids = []
    for t, h, w in grid_thw.tolist():
        ids += [VISION_START] + [IMAGE_TOKEN] * (t * h * w // merge)
    ids += list(range(1, text + 1))
    return torch.tensor([ids])
