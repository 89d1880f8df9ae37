"""Every patch the plugin ships: one module each, named for the patch; add its name to ``NAMES`` once.

The doctor, the self-test, the docs generator and the tests read the specs (``PATCHES``, imported on first use). The
hooks read only the generated ``targets.TARGETS`` at ``import verl``: a patch module is imported when one of its
targets is.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from verl_qwen3vl_plugin.registry import Patch

NAMES = (
    "qwen3_vl_pos_embed",
    "qwen3_vl_moe_sparse_experts",
    "qwen3_vl_single_vision_call",
    "qwen3_vl_vision_dp",
    "qwen3_5_packed_delta_net",
    "qwen3_5_layer_attributes",
    "dp_actor_dynamic_batch_sync",
    "qwen3_vl_nested_position_ids",
    "qwen3_vl_moe_routing_replay",
    "vision_placeholder_ban",
    "overlong_prompt_filter",
    "fused_kernels_sp_labels",
    "freeze_vision_tower",
    "moe_per_expert_sync",
    "npu_qwen3_vl_moe_routing",
    "npu_qwen3_vl_moe_sparse_eval",
    "npu_qwen3_vl_moe_weight_sync",
)


def spec(name: str) -> Patch:
    """The spec of patch ``name`` (its ``spec`` module's ``PATCH``)."""
    return importlib.import_module(f"{__name__}.{name}.spec").PATCH


def __getattr__(attr: str) -> tuple[Patch, ...]:
    if attr != "PATCHES":
        raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
    return tuple(spec(name) for name in NAMES)
