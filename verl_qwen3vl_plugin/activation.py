"""How the plugin became active in this process, and what the start-up hook does once verl is imported.

Three paths load the hook modules: verl >= 0.9's entry-point discovery, verl's ``VERL_USE_EXTERNAL_MODULES`` (every
verl), and the plugin's start-up hook (``startup/verl_qwen3vl_plugin_autoload.py``), which covers verl < 0.9 with no
environment set. Loading is idempotent, so any mix of them patches once.
"""

from __future__ import annotations

import importlib
import os
import sys

from verl_qwen3vl_plugin.registry import HOOK_MODULES, MODULES_ENV

STARTUP_MODULE = "verl_qwen3vl_plugin_autoload"
STARTUP_HOOK, ENTRY_POINTS = "start-up hook", "entry points"


def after_import_verl() -> str:
    """Called by the start-up hook right after verl's ``__init__`` ran; returns what it did.

    verl >= 0.9 is left to its own discovery, so ``VERL_USE_EXTERNAL_PLUGINS`` keeps deciding there.
    """
    from verl_qwen3vl_plugin.environment import verl_discovers_plugins

    if verl_discovers_plugins():
        return "left to verl's entry points"
    if all(module in sys.modules for module in HOOK_MODULES.values()):
        return "hooks already loaded"  # by VERL_USE_EXTERNAL_MODULES, or imported directly
    for module in HOOK_MODULES.values():
        importlib.import_module(module)
    return "loaded"


def activated_by() -> str | None:
    """Which path loaded the plugin's hooks in this process: "start-up hook", "entry points",
    "VERL_USE_EXTERNAL_MODULES", "imported directly", or None when no hook is loaded."""
    loaded = [module for module in HOOK_MODULES.values() if module in sys.modules]
    if not loaded:
        return None
    startup = sys.modules.get(STARTUP_MODULE)
    if getattr(startup, "state", None) == "loaded":
        return STARTUP_HOOK
    if set(loaded) <= set(os.environ.get(MODULES_ENV, "").split(",")):
        return MODULES_ENV
    from verl_qwen3vl_plugin.environment import verl_discovers_plugins

    return ENTRY_POINTS if verl_discovers_plugins() else "imported directly"
