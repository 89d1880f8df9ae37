"""What the installed verl-qwen3vl-plugin distribution holds, as a fresh interpreter outside the checkout sees it."""

import json
from importlib import metadata

dist = metadata.distribution("verl-qwen3vl-plugin")
print(
    json.dumps(
        {
            "version": dist.version,
            "direct_url": json.loads(dist.read_text("direct_url.json") or "{}"),
            "files": sorted(str(f) for f in dist.files),
            "entry_points": {ep.name: ep.value for ep in dist.entry_points if ep.group == "verl.plugins"},
            "scripts": {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"},
        }
    )
)
