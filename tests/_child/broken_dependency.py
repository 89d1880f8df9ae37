"""A plugin that cannot load its hooks' dependency (here: wrapt) must leave ``import verl`` working, warn, and record
the failure; prints the statuses."""

import json
import sys

sys.modules["wrapt"] = None  # import wrapt -> ImportError
import verl  # noqa: E402, F401

import verl_qwen3vl_plugin as plugin  # noqa: E402

print(json.dumps([[s.patch, s.target, s.status.value, s.reason] for s in plugin.patch_statuses()]))
