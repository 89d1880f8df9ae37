"""Entry point ``qwen3vl_model_patch``: the patches of the model group (any device)."""

from verl_qwen3vl_plugin.hooks import watch_group
from verl_qwen3vl_plugin.registry import MODEL

watch_group(MODEL)
