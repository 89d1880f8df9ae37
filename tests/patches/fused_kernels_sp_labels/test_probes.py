"""``fused_kernels_sp_labels``: the probe on the installed verl, verl 0.7's source edited, and the near-misses of
verl 0.8's shape."""

from __future__ import annotations

import pytest

from tests.helpers import VERL, decide_text, source_text, use_sources
from tests.source_edits import NearMisses, Variant, check_near_miss, near_miss_cases, replace, substitute
from verl_qwen3vl_plugin.families import QWEN3_5, QWEN3_VL
from verl_qwen3vl_plugin.patches.fused_kernels_sp_labels import spec
from verl_qwen3vl_plugin.registry import Verdict
from verl_qwen3vl_plugin.upstream import DP_ACTOR

PATCH = spec.PATCH
QWEN3_VL_TARGET, QWEN3_5_TARGET = PATCH.target(QWEN3_VL.verl_forward), PATCH.target(QWEN3_5.verl_forward)
AFFECTED = VERL.release[:2] == (0, 7)
SOURCE = source_text(QWEN3_VL_TARGET.module)
ROLL_LABELS = "torch.roll(labels, shifts=-1, dims=-1)"


def test_installed_verl_decision():
    expected = spec.ROLLS_ITS_INPUT if AFFECTED else spec.TAKES_SHIFT_LABELS
    decision = decide_text(PATCH, QWEN3_VL_TARGET, SOURCE)
    assert (decision.verdict, decision.shape) == (expected.verdict, expected.id), decision.reason
    expected = spec.NO_VERL_QWEN3_5 if AFFECTED else spec.TAKES_SHIFT_LABELS
    decision = decide_text(PATCH, QWEN3_5_TARGET, source_text(QWEN3_5_TARGET.module))
    assert (decision.verdict, decision.shape) == (expected.verdict, expected.id), decision.reason


@pytest.mark.skipif(not AFFECTED, reason="edits of verl 0.7.x's source")
@pytest.mark.parametrize(
    ("name", "module", "old", "new"),
    [
        ("rolls by another shift", QWEN3_VL_TARGET.module, ROLL_LABELS, ROLL_LABELS.replace("-1", "1", 1)),
        ("labels renamed", QWEN3_VL_TARGET.module, "labels: Optional", "targets: Optional"),
        ("actor passes labels", DP_ACTOR, "use_cache=False,", "use_cache=False, labels=input_ids_rmpad_rolled,"),
        ("actor slices the sequence", DP_ACTOR, "ulysses_pad(\n", "ulysses_pad_and_slice_inputs(\n"),
    ],
)  # fmt: skip
def test_edits_of_verl_07_are_unrecognized(monkeypatch, name, module, old, new):
    base = source_text(module)
    edited = base.replace(old, new)
    assert edited != base
    if module == DP_ACTOR:
        use_sources(monkeypatch, {DP_ACTOR: edited})
        edited = SOURCE
    assert decide_text(PATCH, QWEN3_VL_TARGET, edited).verdict is Verdict.UNRECOGNIZED


SHIFT_LABELS_NEAR_MISSES = (
    Variant("the triton forward lacks it", QWEN3_VL_TARGET.module, substitute(
        r"(def forward_with_triton_backend\([^)]*?)shift_labels: Optional\[torch.LongTensor\] = None,", r"\1")),
    Variant("the torch forward renamed", QWEN3_VL_TARGET.module, replace(
        "def forward_with_torch_backend(", "def forward_with_torch(")),
)  # fmt: skip
NEAR_MISSES = [
    NearMisses(PATCH.name, target.label, spec.TAKES_SHIFT_LABELS.id, tuple(
        v._replace(module=target.module) for v in SHIFT_LABELS_NEAR_MISSES))
    for target in (QWEN3_VL_TARGET, QWEN3_5_TARGET)
]  # fmt: skip


@pytest.mark.parametrize(("patch", "target", "variant"), near_miss_cases(NEAR_MISSES))
def test_near_miss_of_a_safe_shape_is_not_called_safe(monkeypatch, patch, target, variant):
    check_near_miss(monkeypatch, patch, target, variant)
