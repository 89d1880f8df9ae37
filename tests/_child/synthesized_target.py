"""Serve a synthesized source under a real target's module name and let the plugin's real hook handle its import.

    synthesized_target.py PATCH MODULE SOURCE_FILE CLASS ATTRIBUTE

Prints PATCH's status on that target and whether ``CLASS.ATTRIBUTE`` was replaced. The synthesized file stands in for an
upstream release the plugin has never seen.
"""

import importlib.machinery
import importlib.util
import json
import sys

import verl  # noqa: F401

patch_name, module_name, source_file, class_name, attribute = sys.argv[1:]


class SynthesizedFinder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == module_name:
            return importlib.util.spec_from_file_location(name, source_file)
        return None


# Just before the file-system finder, so the plugin's import watcher (``import_watch``'s finder) still sees it.
sys.meta_path.insert(sys.meta_path.index(importlib.machinery.PathFinder), SynthesizedFinder)
import verl_qwen3vl_plugin as plugin  # noqa: E402
from verl_qwen3vl_plugin import originals  # noqa: E402
from verl_qwen3vl_plugin.hooks import watch_group  # noqa: E402
from verl_qwen3vl_plugin.patches import PATCHES  # noqa: E402

watch_group(next(p.group for p in PATCHES if p.name == patch_name))
module = importlib.import_module(module_name)
cls = getattr(module, class_name)
(status,) = [s for s in plugin.patch_statuses() if (s.patch, s.target) == (patch_name, module_name)]
print(
    json.dumps(
        {
            "status": status.status.value,
            "reason": status.reason,
            "replaced": originals.ours(cls.__dict__.get(attribute)),
        }
    )
)
