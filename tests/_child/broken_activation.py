"""A start-up hook whose hand-over fails (the plugin package broken) must leave ``import verl`` working and warn."""

import json
import sys

sys.modules["verl_qwen3vl_plugin.activation"] = None  # import -> ImportError inside the start-up hook
import verl  # noqa: E402, F401

print(json.dumps({"verl": verl.__version__, "startup_hook": sys.modules["verl_qwen3vl_plugin_autoload"].state}))
