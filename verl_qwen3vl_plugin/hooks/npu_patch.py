"""Entry point ``qwen3vl_npu_patch``: the patches of verl's Ascend NPU code."""

from verl_qwen3vl_plugin.hooks import watch_group
from verl_qwen3vl_plugin.registry import NPU

watch_group(NPU)
