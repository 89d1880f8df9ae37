"""After ``pip uninstall verl-qwen3vl-plugin``: no start-up hook is left behind, and ``import verl`` still works."""

import sys
import sysconfig
from pathlib import Path

import verl  # noqa: F401

site = Path(sysconfig.get_paths()["purelib"])
left = sorted(p.name for p in site.iterdir() if p.name.startswith(("verl_qwen3vl_plugin", "verl-qwen3vl-plugin")))
assert not left, f"left behind by pip uninstall: {left}"
assert "verl_qwen3vl_plugin_autoload" not in sys.modules
print("uninstall removed the start-up hook; import verl works")
