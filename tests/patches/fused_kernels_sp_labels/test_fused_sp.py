"""``fused_kernels_sp_labels`` in effect: verl 0.7.x's real actor with fused kernels under Ulysses SP = 2, on two
FSDP2 ranks (gloo) that hold different shards of the micro-batch, gives SP = 1's log-probs and gradients
(``fused_sp_actor.py``). Control: without the patch the samples past the first shard differ."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import VERL, child_json
from verl_qwen3vl_plugin.patches.fused_kernels_sp_labels.spec import PATCH

HERE = Path(__file__).parent
pytestmark = pytest.mark.skipif(VERL.release[:2] != (0, 7), reason="verl 0.7.x's fused forwards")
GRAD_RTOL = 1e-5  # float32: SP = 2 sums the same terms in another order


def run(kind: str, plugin: bool = True) -> list[dict]:
    env = None if plugin else {"VERL_QWEN3VL_PLUGIN_DISABLE": PATCH.name}
    results = child_json(HERE / "fused_sp_actor.py", kind, "fsdp2", env=env, timeout=500)
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    return results


@pytest.mark.parametrize(
    "kind", ["dense", pytest.param("moe", marks=pytest.mark.skipif(VERL.release != (0, 7, 1), reason="CI time"))]
)
def test_sp2_equals_sp1_with_fused_kernels(kind):
    for r in run(kind):
        assert r["log_prob_diff"] == 0.0 and r["grad_rel_diff"] < GRAD_RTOL, r
        assert r["statuses"][f"{PATCH.name} {PATCH.targets[0].label}"] == "applied", r


def test_control_without_the_patch_the_second_shard_is_scored_against_the_firsts_labels():
    for r in run("dense", plugin=False):
        assert r["log_prob_diff"] > 0.1 and r["samples_that_differ"] == [1, 2] and r["grad_rel_diff"] > 0.5, r
