"""Entry point ``qwen3vl_model_patch``: the patches of the model group (any device)."""

from verl_qwen3vl_plugin.hooks import install
from verl_qwen3vl_plugin.registry import MODEL

install(MODEL)
