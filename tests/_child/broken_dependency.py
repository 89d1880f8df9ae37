"""A plugin whose modules cannot load (here: ``environment``) must leave ``import verl`` working, warn, and
record the failure of every target; prints the statuses."""

import json
import sys

sys.modules["verl_qwen3vl_plugin.environment"] = None  # import verl_qwen3vl_plugin.environment -> ImportError
import transformers.models.qwen3_vl.modeling_qwen3_vl  # noqa: E402, F401
import verl  # noqa: E402, F401

import verl_qwen3vl_plugin as plugin  # noqa: E402

print(json.dumps([[s.patch, s.target, s.status.value, s.reason] for s in plugin.patch_statuses()]))
