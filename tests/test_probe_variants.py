"""Every verdict other than ``apply`` and ``unrecognized`` stands on a named, known upstream shape, not on the probe
failing to see the affected one: each safe verdict this stack shows must have near-misses in its patch's test module
(``NEAR_MISSES``, run there through ``tests/source_edits.py``).
"""

from __future__ import annotations

import importlib

import pytest

from tests.source_edits import safe_decision, shows
from verl_qwen3vl_plugin.patches import PATCHES

# The patch test modules that hold near-misses (``NEAR_MISSES``), under tests/patches/.
WITH_NEAR_MISSES = (
    "test_dp_actor_dynamic_batch_sync",
    "test_npu_qwen3_vl_moe",
    "test_qwen3_5_packed_delta_net",
    "test_qwen3_vl_moe_routing_replay",
    "test_qwen3_vl_moe_sparse_experts",
    "test_qwen3_vl_nested_position_ids",
    "test_qwen3_vl_pos_embed",
    "test_vision_placeholder_ban",
)
NEAR_MISSES = [s for name in WITH_NEAR_MISSES for s in importlib.import_module(f"tests.patches.{name}").NEAR_MISSES]
SAFE_HERE = [(p, t, d) for p in PATCHES for t in p.targets if (d := safe_decision(p, t)) is not None]


@pytest.mark.parametrize(
    ("patch", "target", "decision"), SAFE_HERE, ids=[f"{p.name}-{t.label}" for p, t, _ in SAFE_HERE]
)
def test_every_safe_verdict_here_has_near_misses(patch, target, decision):
    assert any(shows(s, patch, target, decision) for s in NEAR_MISSES), (
        f"no near-misses for {decision} of {patch.name} on {target.label}"
    )
