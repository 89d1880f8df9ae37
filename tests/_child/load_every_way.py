"""The start-up hook, VERL_USE_EXTERNAL_MODULES, the entry points (verl >= 0.9) and a stray direct install, all in one
process: each patch must be registered once (one log line per target, run with VERL_LOGGING_LEVEL=INFO) and
verl's function wrapped at most once."""

import verl  # noqa: F401
import wrapt
from transformers.models.qwen3_vl import modeling_qwen3_vl  # noqa: F401
from verl.models.transformers import monkey_patch

from verl_qwen3vl_plugin.hooks import install
from verl_qwen3vl_plugin.registry import MODEL

install(MODEL)
inner = getattr(monkey_patch.apply_monkey_patch, "__wrapped__", None)  # wrapped on verl >= 0.8 only
assert not isinstance(inner, wrapt.FunctionWrapper), "apply_monkey_patch wrapped twice"
print("ok")
