"""What ``import verl`` does to the plugin in a process started as the user's are: the doctor runs this module in a
child with the user's environment (``python -m verl_qwen3vl_plugin.import_verl_probe``) and reads the JSON it prints,
so whether verl loads the plugin is observed, not only inferred."""

from __future__ import annotations

import json
import sys

from verl_qwen3vl_plugin.activation import STARTUP_MODULE, activated_by
from verl_qwen3vl_plugin.registry import HOOK_MODULES


def observe() -> dict[str, object]:
    """Which hooks this process loaded, by which path, and what the start-up hook did."""
    startup = sys.modules.get(STARTUP_MODULE)
    return {
        "hooks": [m for m in HOOK_MODULES.values() if m in sys.modules],
        "activated_by": activated_by(),
        "startup_hook": getattr(startup, "state", None),
    }


if __name__ == "__main__":
    import verl  # noqa: F401

    print(json.dumps(observe()))
