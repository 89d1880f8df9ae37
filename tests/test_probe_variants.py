"""Every verdict other than ``apply`` and ``unrecognized`` stands on a named, known upstream shape, not on the probe
failing to see the affected one: each safe verdict this stack shows must have near-misses in its patch's test module
(``NEAR_MISSES``, run there through ``tests/source_edits.py``).
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest

from tests import patches as test_patches
from tests.source_edits import safe_decision, shows
from verl_qwen3vl_plugin.patches import PATCHES

# Each patch's probe tests (``tests/patches/<patch>/test_probes.py``) hold its near-misses (``NEAR_MISSES``): found,
# not listed.
MODULES = [
    importlib.import_module(m.name)
    for m in pkgutil.walk_packages(test_patches.__path__, f"{test_patches.__name__}.")
    if m.name.rsplit(".", 1)[-1] == "test_probes" or m.name.count(".") == 2 and not m.ispkg
]
NEAR_MISSES = [s for module in MODULES for s in getattr(module, "NEAR_MISSES", ())]
SAFE_HERE = [(p, t, d) for p in PATCHES for t in p.targets if (d := safe_decision(p, t)) is not None]


@pytest.mark.parametrize(
    ("patch", "target", "decision"), SAFE_HERE, ids=[f"{p.name}-{t.label}" for p, t, _ in SAFE_HERE]
)
def test_every_safe_verdict_here_has_near_misses(patch, target, decision):
    assert any(shows(s, patch, target, decision) for s in NEAR_MISSES), (
        f"no near-misses for {decision} of {patch.name} on {target.label}"
    )
