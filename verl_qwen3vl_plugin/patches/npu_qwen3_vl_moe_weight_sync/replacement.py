"""verl's NPU Qwen3-VL-MoE experts, handed to verl 0.9's weight-sync split in the layout that split assumes.

Why: verl 0.9's ``unfuse_moe_params`` cuts packed experts as transformers 5 lays them out, while verl's Ascend
Qwen3-VL-MoE block keeps transformers 4.57's layout, so the rollout receives mis-split experts.
How: transpose the NPU block's packed tensors (views, no copy) before verl's own split runs.
When it applies, and when it can be removed: the ``npu_qwen3_vl_moe_weight_sync`` spec.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterable, Iterator

import torch

NPU_PATCH_MODULE = "verl.models.transformers.npu_patch"
QWEN3_VL_MOE_MODELING = "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe"
NPU_QWEN3_VL_MOE_BLOCK = "NPUQwen3VLMoeTextSparseMoeBlock"


def experts_to_transformers5_layout(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Weight-sync pairs with verl's NPU experts as transformers 5 lays them out, for splits written for that layout.

    verl's NPU block keeps transformers 4.57's packing: ``gate_up_proj`` (E, H, 2I) and ``down_proj`` (E, I, H).
    transformers 5 stores their per-expert transposes, (E, 2I, H) and (E, H, I). Views only: nothing is copied here.
    """
    for name, tensor in weights:
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) and tensor.dim() == 3:
            tensor = tensor.transpose(1, 2)
        yield name, tensor


def npu_block_in_use() -> bool:
    """Whether transformers' Qwen3-VL-MoE module builds verl's NPU block (what verl's npu_patch swaps in)."""
    block = getattr(sys.modules.get(NPU_PATCH_MODULE), NPU_QWEN3_VL_MOE_BLOCK, None)
    modeling = sys.modules.get(QWEN3_VL_MOE_MODELING)
    return block is not None and getattr(modeling, "Qwen3VLMoeTextSparseMoeBlock", None) is block


def layout_aware(unfuse: Callable) -> Callable:
    """verl's ``unfuse_moe_params``, fed verl's NPU Qwen3-VL-MoE experts in transformers 5's layout.

    Arguments pass through as given: only ``model_type`` is read, by name from verl's own signature.
    """
    signature = inspect.signature(unfuse)

    @functools.wraps(unfuse)
    def unfuse_moe_params(weights, *args, **kwargs):
        bound = signature.bind(weights, *args, **kwargs)
        bound.apply_defaults()
        model_type = bound.arguments.get("model_type")
        if model_type == "qwen3_vl_moe" and npu_block_in_use():
            weights = experts_to_transformers5_layout(weights)
        return unfuse(weights, *args, **kwargs)

    return unfuse_moe_params
