"""``qwen3_vl_vision_dp``: its decision from the installed and edited sources, the assignment of images to ranks,
and the tower split over two real gloo ranks (the patch's ``selftest``) on this stack's transformers."""

from __future__ import annotations

import ast
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import child_json, decide_text, source_text
from verl_qwen3vl_plugin.families import QWEN3_5, QWEN3_VL
from verl_qwen3vl_plugin.patches.qwen3_vl_vision_dp import selftest as vision_dp
from verl_qwen3vl_plugin.patches.qwen3_vl_vision_dp import spec
from verl_qwen3vl_plugin.patches.qwen3_vl_vision_dp.replacement import assign
from verl_qwen3vl_plugin.registry import Verdict

HERE = Path(__file__).parent  # this patch's child scripts

VERL_SOURCE = source_text("verl.models.transformers.monkey_patch")


@pytest.mark.parametrize("target", spec.PATCH.targets, ids=lambda t: t.module.rsplit(".", 1)[-1])
def test_installed_sources_apply(target):
    source = source_text(target.module)
    decision = decide_text(spec.PATCH, target, source)
    verdict, reason = decision.verdict, decision.reason
    if source is None:  # Qwen3.5 on transformers < 5.2
        assert verdict is Verdict.NOT_USED and "Qwen3.5" in reason, reason
        return
    assert verdict is Verdict.APPLY and decision.shape == "tower-on-every-rank/slices-after-tower", reason


@pytest.mark.parametrize(
    "edit",
    [
        ("grid_thw: torch.Tensor, **kwargs", "grid_thw: torch.Tensor, cu_seqlens, **kwargs"),
        ("return hidden_states, deepstack_feature_lists", "return hidden_states"),
        ("return BaseModelOutputWithDeepstackFeatures(", "return BaseModelOutputWithPooling("),
        ("return BaseModelOutputWithPooling(", "return BaseModelOutputWithDeepstackFeatures("),
    ],
    ids=["signature", "4.57 return", "5.x return", "qwen3_5 return"],
)
@pytest.mark.parametrize("family", [QWEN3_VL, QWEN3_5], ids=lambda f: f.model_type)
def test_edited_vision_forward_is_unrecognized(edit, family):
    target = spec.PATCH.target(family.modeling)
    source = source_text(target.module)
    forward = source and source[source.index(f"class {family.vision_class}(") :]
    if not forward or edit[0] not in forward:
        pytest.skip(f"this transformers' {target.module} has no {edit[0]!r}")
    source = source.replace(forward, forward.replace(*edit, 1))
    decision = decide_text(spec.PATCH, target, source)
    assert decision.verdict is Verdict.UNRECOGNIZED, decision.reason


@pytest.mark.parametrize("family", [QWEN3_VL, QWEN3_5], ids=lambda f: f.model_type)
def test_verl_slicing_before_the_tower_is_unrecognized(family):
    """The premise: without verl's slicing at the language model, ranks may hold different images. Each line's own
    slicing counts: Qwen3.5's tower is not covered by verl slicing Qwen3-VL."""
    call = f"{spec.VERL_SLICER}({family.line_prefix}"
    if call not in VERL_SOURCE:
        pytest.skip(f"this verl has no {family.line}")
    assert spec.probe_verl(ast.parse(VERL_SOURCE), family).verdict is Verdict.APPLY
    decision = spec.probe_verl(ast.parse(VERL_SOURCE.replace(call, f"print({family.line_prefix}")), family)
    assert decision.verdict is Verdict.UNRECOGNIZED and family.line in decision.reason, decision
    assert spec.probe_verl(None, family).verdict is Verdict.UNRECOGNIZED


def test_verls_own_opt_in_vision_dp_still_applies():
    """verl#5230 adds its own vision DP to apply_monkey_patch, off by default, and keeps the slicing: the plugin
    still applies, and steps aside at run time on a class verl's wrapper marked (the self-test's last check)."""
    own = (
        "\n    if vision_dp:\n        Qwen3VLVisionModel.forward = create_dp_vision_forward(Qwen3VLVisionModel.forward)"
        "\n        Qwen3VLVisionModel._vision_dp_patched = True\n"
    )
    func = VERL_SOURCE.index("def apply_monkey_patch(")
    body = VERL_SOURCE.index(":\n", VERL_SOURCE.index(")", func)) + 1
    edited = VERL_SOURCE[:body] + own + VERL_SOURCE[body:]
    assert spec.probe_verl(ast.parse(edited)).verdict is Verdict.APPLY


@pytest.mark.parametrize(
    "patches, ranks, runs",
    [
        ([24, 64, 4], 2, [(0, 1), (1, 3)]),
        ([24], 2, [(0, 0), (0, 1)]),  # fewer images than ranks: rank 0 runs the dummy
        ([4, 256, 8, 8], 2, [(0, 2), (2, 4)]),  # the large one with the small one before it
        ([16] * 8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
        ([16] * 3, 8, [(0, 0), (0, 1), (1, 1), (1, 1), (1, 2), (2, 2), (2, 3), (3, 3)]),
        ([], 2, [(0, 0), (0, 0)]),
    ],
)
def test_assign_contiguous_runs_balanced_by_patches(patches, ranks, runs):
    assert assign(patches, ranks) == runs


def test_assign_rejects_no_ranks():
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        assign([4], 0)


def test_split_tower_on_two_ranks_matches_upstream():
    checks = vision_dp.run()
    assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


@pytest.fixture(scope="module")
def premise() -> dict[str, list[dict]]:
    """``vision_dp_premise.py`` in both modes at once, bounded: gloo's 10 s timeout, 60 s of wall clock."""
    modes = ("checked", "unchecked")
    with ThreadPoolExecutor(len(modes)) as pool:
        runs = pool.map(lambda mode: child_json(HERE / "vision_dp_premise.py", mode, "10", "60", timeout=180), modes)
        return dict(zip(modes, runs, strict=True))


def test_ranks_holding_different_images_raise_the_same_clear_error(premise):
    raised = [r.get("raised") for r in premise["checked"]]
    assert raised[0] == raised[1] and "hold different images" in raised[0], raised
    assert "rank 0: 2 images, 28 patches" in raised[0] and "rank 1: 2 images, 32 patches" in raised[0], raised


def test_negative_control_without_the_agreement_the_split_goes_on_silently(premise):
    """The mismatch the agreement step catches: the ranks split different lists, and nothing says so."""
    assert all(r.get("finished") for r in premise["unchecked"]), premise["unchecked"]


def test_fallback_warns_once_per_process_and_the_split_logs_at_debug(premise):
    for rank, r in enumerate(premise["checked"]):
        levels = [level for level, _ in r["logs"]]
        assert levels == ["WARNING", "DEBUG"], r
        assert "['unexpected']" in r["logs"][0][1] and f"rank {rank} of 2 runs images" in r["logs"][1][1], r
