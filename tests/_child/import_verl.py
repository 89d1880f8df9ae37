"""``import verl`` as a user's process does it; prints which hooks got loaded, how, and each patch's status."""

import json
import sys

import verl  # noqa: F401

import verl_qwen3vl_plugin as plugin

print(
    json.dumps(
        {
            "hooks": sorted(m for m in sys.modules if m.startswith("verl_qwen3vl_plugin.hooks.")),
            "activated_by": plugin.activated_by(),
            "startup_hook": getattr(sys.modules.get("verl_qwen3vl_plugin_autoload"), "state", None),
            "plugin_file": plugin.__file__,
            "status": {f"{s.patch} {s.target}": s.status.value for s in plugin.patch_statuses()},
        }
    )
)
