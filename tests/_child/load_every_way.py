"""The start-up hook, VERL_USE_EXTERNAL_MODULES, the entry points (verl >= 0.9) and a stray direct install, all in one
process: each patch must be registered once (one log line per target, run with VERL_LOGGING_LEVEL=INFO) and
verl's function wrapped once, around verl's own."""

import verl  # noqa: F401
from transformers.models.qwen3_vl import modeling_qwen3_vl  # noqa: F401
from verl.models.transformers import monkey_patch

from verl_qwen3vl_plugin import originals
from verl_qwen3vl_plugin.hooks import watch_group
from verl_qwen3vl_plugin.registry import MODEL

watch_group(MODEL)
assert monkey_patch.apply_monkey_patch.__wrapped__ is originals.original(monkey_patch, "apply_monkey_patch")
assert originals.original(monkey_patch, "apply_monkey_patch").__code__.co_filename == monkey_patch.__file__
print("ok")
