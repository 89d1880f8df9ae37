"""Vision DP through verl's real Ulysses path on two CPU ranks (gloo): SP = 2 with the plugin against SP = 1.

verl 0.7.x: ``DataParallelPPOActor._forward_micro_batch`` with remove-padding after ``apply_monkey_patch(model,
ulysses_sp_size=2)``; verl 0.8 / 0.9 (no such actor): the FSDP engine's own ``FSDPEngineWithLMHead.forward_step``
(``verl_qwen3vl_plugin.selftest.ulysses`` names the CPU stand-ins). Each rank's tower must see only its share of the
patches, every rank must make the same tower calls, and log-probs, entropies and gradients must match SP = 1.
Qwen3.5 and Qwen3.5-MoE (verl >= 0.8, transformers >= 5.2) too.
"""

from __future__ import annotations

import pytest

from tests.helpers import QWEN3_5_TRAINED, VERL, child_json
from verl_qwen3vl_plugin.patches.qwen3_vl_vision_dp.replacement import assign
from verl_qwen3vl_plugin.selftest.tiny_models import VISION

CASES = {  # the child's cases, as patch counts per tower call (images, then videos)
    "mixed": [[24, 4, 64, 16]],
    "fewer_images": [[16]],
    "large": [[4, 256, 8, 8]],
    "video": [[16, 32]],  # the image and the video in one tower call (qwen3_vl_single_vision_call)
    "text_only": [[16]],  # verl's own dummy image for a text-only micro-batch
}
DUMMY = VISION["spatial_merge_size"] ** 2  # what a rank without an image runs
# fp32 rounding: a rank's tower computes a subset of the rows, and gradients are summed in another order.
LOG_PROB_ATOL, GRAD_RTOL = 1e-5, 1e-5
# Qwen3.5, with its gated delta-net layers under SP too: 2e-5 seen on small gradients (fp32 sums in another order).
QWEN3_5_GRAD_RTOL = 1e-4


def run(kind: str, cases: list[str], *args: str, env: dict[str, str] | None = None) -> list[dict]:
    """One pair of ranks for all ``cases`` (their start-up is most of the time): per rank, {case: result}."""
    results = child_json("ulysses_actor.py", kind, ",".join(cases), *args, env=env, timeout=900)
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    for r in results:
        assert r["vision_dp_applied"] is (env is None), r
        assert r["tower_is_ours"] is (env is None), r
    return results


def expected_rows(case: str) -> list[list[int]]:
    """Per rank, the rows its tower sees in each call: its share, or the dummy."""
    per_call = [[sum(p[s:e]) or DUMMY for s, e in assign(p, 2)] for p in CASES[case]]
    return [[call[rank] for call in per_call] for rank in (0, 1)]


def check_case(results: list[dict], case: str, grad_rtol: float = GRAD_RTOL) -> None:
    per_rank = [r[case] for r in results]
    for r in per_rank:
        assert r["log_prob_diff"] <= LOG_PROB_ATOL and r["entropy_diff"] <= LOG_PROB_ATOL, (case, r)
        assert r["grad_rel_diff"] <= grad_rtol, (case, r)
    assert [r["sp2_patch_rows"] for r in per_rank] == expected_rows(case), case
    sp1_calls = per_rank[0]["sp1_patch_rows"]
    assert {len(r["sp2_patch_rows"]) for r in per_rank} == {len(sp1_calls)}, "every rank makes SP = 1's tower calls"
    shares = [sum(rows) for rows in zip(*(r["sp2_patch_rows"] for r in per_rank), strict=True)]
    assert all(s in (total, total + DUMMY) for s, total in zip(shares, sp1_calls, strict=True)), (shares, sp1_calls)
    if case in ("mixed", "large"):
        assert per_rank[0]["boundary_inside_image"], "the case must put an SP boundary inside an image"


@pytest.fixture(scope="module")
def dense_results() -> list[dict]:
    return run("dense", list(CASES), "none")


@pytest.mark.parametrize("case", list(CASES))
def test_dense_sp2_with_vision_dp_matches_sp1(dense_results, case):
    check_case(dense_results, case)


@pytest.mark.parametrize("kind, fsdp", [("moe", "none"), ("dense", "fsdp2"), ("moe", "fsdp2_offload")])
def test_moe_and_under_fsdp2_on_the_two_ranks(kind, fsdp):
    cases = ["mixed", "fewer_images"]
    results = run(kind, cases, fsdp)
    for case in cases:
        check_case(results, case)


@pytest.mark.skipif(not QWEN3_5_TRAINED, reason="Qwen3.5 needs verl >= 0.8 and transformers >= 5.2")
@pytest.mark.parametrize("kind, fsdp", [("qwen3_5", "none"), ("qwen3_5_moe", "fsdp2")])
def test_qwen3_5_sp2_with_vision_dp_matches_sp1(kind, fsdp):
    cases = ["mixed", "video"]
    results = run(kind, cases, fsdp)
    for case in cases:
        check_case(results, case, QWEN3_5_GRAD_RTOL)


@pytest.mark.skipif(
    VERL.release not in ((0, 7, 1), (0, 9, 1)), reason="the harness's two verl code paths (0.7's actor, 0.9's engine)"
)
def test_negative_control_gather_in_the_wrong_order_fails():
    """The harness sees a wrong gather: the ranks' blocks returned in reverse order."""
    for r in run("dense", ["mixed"], "none", "shuffled"):
        assert r["mixed"]["log_prob_diff"] > 1e-3 and r["mixed"]["grad_rel_diff"] > 1e-2, r


def test_without_the_patch_every_rank_runs_every_image():
    """verl's own behaviour, the waste the patch removes (and the same numbers)."""
    results = run("dense", ["mixed"], "none", env={"VERL_QWEN3VL_PLUGIN_DISABLE": "qwen3_vl_vision_dp"})
    for r in (r["mixed"] for r in results):
        assert r["sp2_patch_rows"] == r["sp1_patch_rows"] == [108], r
        assert r["log_prob_diff"] <= LOG_PROB_ATOL and r["grad_rel_diff"] <= GRAD_RTOL, r
