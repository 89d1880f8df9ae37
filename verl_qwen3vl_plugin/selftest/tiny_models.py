"""Tiny random Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE models built from configs: no hub download, a few
hundred kB each. Qwen3.5's classes exist from transformers 5.2, so its builders import them when called."""

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
# Qwen3.5: a gated delta-net (linear attention) layer, then a full-attention one, as the real models interleave them.
QWEN3_5_TEXT = dict(
    {k: v for k, v in TEXT.items() if k != "rope_scaling"},
    linear_conv_kernel_dim=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=2, layer_types=["linear_attention", "full_attention"],
    rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1], "mrope_interleaved": True,
        "partial_rotary_factor": 0.5,
    },
)  # fmt: skip
QWEN3_5_MOE_TEXT = dict(
    {k: v for k, v in QWEN3_5_TEXT.items() if k != "intermediate_size"},
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=16,
)  # fmt: skip
TOKENS = dict(image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START)


def vision_tower(
    hidden: int = 32, table: int = 2304, dtype: torch.dtype = torch.float32, family: str = "qwen3_vl"
) -> torch.nn.Module:
    """A one-block vision tower (``family``: ``qwen3_vl`` or ``qwen3_5``) whose position table is 48 x 48 like
    theirs, with seeded random entries."""
    sizes = dict(depth=1, hidden_size=hidden, intermediate_size=16, num_heads=1, out_hidden_size=hidden,
                 num_position_embeddings=table)  # fmt: skip
    if family == "qwen3_5":
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

        tower = Qwen3_5VisionModel(Qwen3_5VisionConfig(**sizes))
    else:
        tower = Qwen3VLVisionModel(Qwen3VLVisionConfig(**sizes, deepstack_visual_indexes=[]))
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


def has_qwen3_5(verl: bool = False) -> bool:
    """Whether transformers has Qwen3.5 (>= 5.2) and, with ``verl``, verl its Qwen3.5 forward (>= 0.8)."""
    import importlib.util

    modules = ["transformers.models.qwen3_5", *(["verl.models.transformers.qwen3_5"] if verl else [])]
    return all(importlib.util.find_spec(module) is not None for module in modules)


def tiny_qwen3_5(seed: int = 0, moe: bool = False, layer_types: list[str] | None = None, **text) -> torch.nn.Module:
    """A tiny Qwen3.5 (``moe``: Qwen3.5-MoE) with Qwen3-VL's tiny vision tower minus deepstack; ``layer_types``
    overrides the text layers', ``text`` the rest of the text config."""
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    torch.manual_seed(seed)
    text = {
        **(QWEN3_5_MOE_TEXT if moe else QWEN3_5_TEXT),
        **({"layer_types": layer_types} if layer_types else {}),
        **text,
    }
    vision = {k: v for k, v in VISION.items() if k != "deepstack_visual_indexes"}
    config_cls, model_cls = (
        (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration)
        if moe
        else (Qwen3_5Config, Qwen3_5ForConditionalGeneration)
    )
    return model_cls(config_cls(text_config=text, vision_config=vision, **TOKENS)).eval()


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
