"""The pytest process itself never loads the plugin through verl: the start-up hook is off, discovery is off and
nothing is exported, so upstream implementations are captured unpatched here. Every test of activation and hooks
runs in a fresh subprocess with the environment it states (``tests/helpers.py``)."""

import os

os.environ["VERL_QWEN3VL_PLUGIN_AUTOLOAD"] = "0"  # read again at `import verl`, so this takes effect
os.environ["VERL_USE_EXTERNAL_PLUGINS"] = "none"
os.environ.pop("VERL_USE_EXTERNAL_MODULES", None)
os.environ.pop("VERL_QWEN3VL_PLUGIN_DISABLE", None)
