"""What ``import verl`` does to the plugin in a process started as the user's are: the doctor runs this module in a
child with the user's environment (``python -m verl_qwen3vl_plugin.import_verl_probe``) and reads the JSON it prints,
so whether verl loads the plugin is observed, not only inferred. It also imports verl's forward module of each model
line the plugin patches: the probes read source and never see one that cannot import (verl 0.9.1's Qwen3-VL module
on transformers >= 5.23, which removed a class it imports)."""

from __future__ import annotations

import importlib
import json
import sys

from verl_qwen3vl_plugin import environment
from verl_qwen3vl_plugin.activation import STARTUP_MODULE, activated_by
from verl_qwen3vl_plugin.families import FAMILIES
from verl_qwen3vl_plugin.registry import HOOK_MODULES


def observe() -> dict[str, object]:
    """Which hooks this process loaded, by which path, and what the start-up hook did."""
    startup = sys.modules.get(STARTUP_MODULE)
    return {
        "hooks": [m for m in HOOK_MODULES.values() if m in sys.modules],
        "activated_by": activated_by(),
        "startup_hook": getattr(startup, "state", None),
    }


def model_modules() -> dict[str, str | None]:
    """verl's forward module of each model line this verl ships -> the error importing it raised (None: it
    imported)."""
    errors = {}
    for module in dict.fromkeys(f.verl_forward for f in FAMILIES):
        if environment.module_path(module) is None:
            continue
        try:
            importlib.import_module(module)
            errors[module] = None
        except Exception as exc:  # the doctor reports it; any error means verl cannot train the line here
            errors[module] = f"{type(exc).__name__}: {exc}"
    return errors


if __name__ == "__main__":
    import verl  # noqa: F401

    print(json.dumps(observe() | {"model_modules": model_modules()}))
