"""``dp_actor_dynamic_batch_sync``: its decisions on the installed verl and on edits of verl 0.7.1's source, verl's
own ``prepare_dynamic_batch`` on two ranks (the patch's ``selftest``), and verl 0.7.x's real actor
with dynamic batching on two FSDP2 ranks (``dynamic_batch_actor.py``, beside this file), with the patch and without it.
On verl 0.7.0, near-misses of its split, which the probe calls fixed upstream (``tests/source_edits.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import VERL, child_json, decide_text, last_json, run_child, source_text, use_sources
from tests.source_edits import APPLY, NearMisses, Variant, check_near_miss, near_miss_cases, replace, substitute
from verl_qwen3vl_plugin.patches.dp_actor_dynamic_batch_sync import selftest as dynamic_batch
from verl_qwen3vl_plugin.patches.dp_actor_dynamic_batch_sync import spec as sync
from verl_qwen3vl_plugin.registry import Verdict

HERE = Path(__file__).parent  # this patch's child scripts

PATCH = sync.PATCH
BALANCING, ENGINE_UTILS = "verl.utils.seqlen_balancing", "verl.workers.engine.utils"
ENGINE = "verl.workers.engine.fsdp.transformer_impl"
ACTOR, CRITIC = PATCH.target("verl.workers.actor.dp_actor"), PATCH.target("verl.workers.critic.dp_critic")
LEGACY = VERL.release[:2] == (0, 7)
AFFECTED = VERL.release == (0, 7, 1)
EXPECTED = Verdict.APPLY if AFFECTED else Verdict.FIXED_UPSTREAM if LEGACY else Verdict.NOT_USED


@pytest.mark.parametrize("target", [ACTOR, CRITIC], ids=["actor", "critic"])
def test_installed_verl_decision(target):
    decision = decide_text(PATCH, target, source_text(target.module))
    verdict, reason = decision.verdict, decision.reason
    assert verdict is EXPECTED, reason


@pytest.mark.skipif(not AFFECTED, reason="edits of verl 0.7.1's source")
class TestEditedSources:
    ACTOR_SOURCE = source_text(ACTOR.module)
    CALL = "prepare_dynamic_batch(data, max_token_len=max_token_len)"

    def test_callers_passing_dp_group_are_fixed_upstream(self):
        fixed = self.ACTOR_SOURCE.replace("max_token_len=max_token_len)", "max_token_len=max_token_len, dp_group=g)")
        assert fixed != self.ACTOR_SOURCE
        decision = decide_text(PATCH, ACTOR, fixed)
        verdict, reason = decision.verdict, decision.reason
        assert verdict is Verdict.FIXED_UPSTREAM and decision.shape == "passes-dp-group", reason

    def test_one_caller_passing_dp_group_is_unrecognized(self):
        one = self.ACTOR_SOURCE.replace(self.CALL, self.CALL.replace(")", ", dp_group=g)"), 1)
        assert one != self.ACTOR_SOURCE
        assert decide_text(PATCH, ACTOR, one).verdict is Verdict.UNRECOGNIZED

    def test_split_through_a_helper_of_another_name_is_unrecognized(self):
        other = self.ACTOR_SOURCE.replace(self.CALL, self.CALL.replace("prepare_dynamic_batch", "split_batches"))
        assert other != self.ACTOR_SOURCE
        assert decide_text(PATCH, ACTOR, other).verdict is Verdict.UNRECOGNIZED

    def test_split_without_the_guard_is_verl_070(self, monkeypatch):
        balancing = source_text(BALANCING)
        unguarded = balancing.replace(" and dp_group is not None:", ":")
        assert unguarded != balancing
        use_sources(monkeypatch, {BALANCING: unguarded})
        decision = decide_text(PATCH, ACTOR, self.ACTOR_SOURCE)
        verdict, reason = decision.verdict, decision.reason
        assert verdict is Verdict.FIXED_UPSTREAM and decision.shape == "verl0.7.0-syncs-over-default-group", reason


def test_module_absent_without_verl08s_engine_is_unrecognized(monkeypatch):
    """verl >= 0.8's positive match is its engine's split: a verl with neither is not called safe."""
    use_sources(monkeypatch, {ENGINE: "class FSDPEngine:\n    pass\n"})
    assert decide_text(PATCH, ACTOR, None).verdict is Verdict.UNRECOGNIZED


@pytest.mark.skipif(not LEGACY, reason="verl 0.7.x's legacy actor")
def test_selftest_counts_agree_with_the_plugin():
    (check,) = dynamic_batch.run()
    assert check.ok, check
    expected_verl = "[2, 1]" if AFFECTED else "[2, 2]"
    assert AFFECTED is (f"verl {expected_verl}" in check.detail), check


@pytest.mark.skipif(not LEGACY, reason="verl 0.7.x's legacy actor")
def test_real_actor_on_fsdp2_ranks_of_different_lengths():
    results = child_json(HERE / "dynamic_batch_actor.py", timeout=600)
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    counts = [r["micro_batches"] for r in results]
    assert counts[0] == counts[1] and counts[0]["compute_log_prob"] == counts[0]["update_policy"] == 2, counts
    for r in results:
        assert r["log_prob_diff"] <= 1e-5, r
        assert r["statuses"][f"{PATCH.name} {ACTOR.module}"] == ("applied" if AFFECTED else "skipped"), r


@pytest.mark.skipif(not AFFECTED, reason="the hang of verl 0.7.1")
def test_negative_control_without_the_patch_the_ranks_fail_within_bounds():
    proc = run_child(
        HERE / "dynamic_batch_actor.py", "10", "60", env={"VERL_QWEN3VL_PLUGIN_DISABLE": PATCH.name}, timeout=200
    )
    assert all("error" in r for r in last_json(proc)), proc.stdout[-2000:]


# verl 0.7.0's split syncs its micro-batch count under this guard alone; 0.7.1 adds "and dp_group is not None".
GUARD_070 = "if dist.is_initialized() and same_micro_num_in_dp:"
NAMED_GUARD = f"sync = {GUARD_070[3:-1]} and dp_group is not None\n    if sync"
SPLIT_NEAR_MISSES = (
    Variant("guard on the group's truth", BALANCING, replace(GUARD_070, GUARD_070[:-1] + " and dp_group:")),
    # The guard through a named condition is verl 0.7.1's behaviour: the patch passes a group, so it works.
    Variant("guard through a named condition", BALANCING, replace(GUARD_070, NAMED_GUARD + ":"), APPLY),
    Variant(
        "early return without a group",
        BALANCING,
        replace(GUARD_070, "if dp_group is None:\n        pass\n    " + GUARD_070),
    ),
    Variant("named guard in a compound test", BALANCING, replace(GUARD_070, NAMED_GUARD + " and True:")),
    Variant(
        "group passed by position",
        BALANCING,
        replace("op=dist.ReduceOp.MAX, group=dp_group)", "dist.ReduceOp.MAX, dp_group)"),
    ),
    Variant("renamed split", BALANCING, substitute(r"\brearrange_micro_batches\(", "split_micro_batches(")),
    Variant(
        "extra argument before dp_group",
        BALANCING,
        substitute(
            r"def prepare_dynamic_batch\(\s*data(: [\w.]+)?,\s*max_token_len(: \w+)?,",
            "def prepare_dynamic_batch(data, max_token_len, extra,",
        ),
    ),
)
ENGINE_NEAR_MISSES = (
    Variant("engine passes no group", ENGINE, replace("dp_group=self.get_data_parallel_group()", "dp_group=None")),
    Variant(
        "engine splits by another call", ENGINE, substitute(r"\bprepare_micro_batches\(", "rearrange_micro_batches(")
    ),
    Variant(
        "renamed split in the helper", ENGINE_UTILS, substitute(r"\brearrange_micro_batches\(", "split_micro_batches(")
    ),
    Variant("helper drops the group", ENGINE_UTILS, substitute(r"dp_group=dp_group,", "dp_group=None,")),
)
NEAR_MISSES = [
    *(NearMisses(PATCH.name, t.label, sync.SYNCS_OVER_DEFAULT_GROUP.id, SPLIT_NEAR_MISSES) for t in (ACTOR, CRITIC)),
    # verl >= 0.8's shape is each target's ``absent``: near-misses of the engine it reads.
    *(NearMisses(PATCH.name, t.label, sync.ENGINE_PASSES_DP_GROUP.id, ENGINE_NEAR_MISSES) for t in (ACTOR, CRITIC)),
]


@pytest.mark.parametrize(("patch", "target", "variant"), near_miss_cases(NEAR_MISSES))
def test_near_miss_of_a_safe_shape_is_not_called_safe(monkeypatch, patch, target, variant):
    check_near_miss(monkeypatch, patch, target, variant)
