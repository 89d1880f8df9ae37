"""Entry point: Qwen3-VL-MoE routing weights in training for verl 0.7.1's Ascend NPU MoE block."""

from verl_qwen3vl_plugin.registry import NPU_MOE_ROUTING, install_patch

install_patch(NPU_MOE_ROUTING, "verl_qwen3vl_plugin.patches.npu_qwen3_vl_moe")
