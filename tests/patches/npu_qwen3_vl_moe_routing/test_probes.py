"""``npu_qwen3_vl_moe_routing``: its decision on the installed verl and on edits of verl 0.7.1's NPU block, through
``registry.decide`` (what the hooks and the doctor both call), and near-misses of the verl shapes its probe calls
fixed upstream (``tests/source_edits.py``). The block's numbers are tested in ``test_numerics.py``."""

from __future__ import annotations

import pytest

from tests.helpers import VERL, decide_text, source_text
from tests.npu_fixture import NPU_PATCH
from tests.source_edits import (
    APPLY,
    NearMisses,
    Variant,
    check_near_miss,
    extra_parameter,
    guard_scatter,
    in_method,
    near_miss_cases,
    prepend_to,
    scatter_not_in_place,
    scatter_unless_training,
    unpermute_with_float_weights,
)
from verl_qwen3vl_plugin.patches.npu_qwen3_vl_moe_routing import spec as routing
from verl_qwen3vl_plugin.registry import Decision, Verdict

NPU = routing.PATCH
NPU_BLOCK = NPU.target(NPU_PATCH)
NPU_SOURCE = source_text(NPU_PATCH)
GUARD = "        if not self.training:\n            routing_weights = torch.zeros_like"
TRAINING_GATHER = "selected_probs = routing_weights[batch_idx, router_indices]"


def npu_verdict(source: str | None) -> Decision:
    return decide_text(NPU, NPU_BLOCK, source)


def test_installed_verl_npu_decision():
    decision = npu_verdict(NPU_SOURCE)
    verdict, reason = decision.verdict, decision.reason
    assert verdict is (Verdict.APPLY if VERL.release == (0, 7, 1) else Verdict.FIXED_UPSTREAM), reason


@pytest.mark.skipif(VERL.release != (0, 7, 1), reason="edits of verl 0.7.1's source")
class TestEditedNpuSource:
    def test_always_scattering_block_is_fixed_upstream(self):
        """verl >= 0.8's shape: the guard removed."""
        fixed = NPU_SOURCE.replace(GUARD, "        routing_weights = torch.zeros_like")
        assert fixed != NPU_SOURCE
        decision = npu_verdict(fixed)
        verdict, reason = decision.verdict, decision.reason
        assert verdict is Verdict.FIXED_UPSTREAM and decision.shape == "verl0.8-scatters", reason

    def test_experts_taking_top_k_weights_are_verl_070(self):
        v070 = NPU_SOURCE.replace("probs=selected_probs", "probs=routing_weights")
        assert v070 != NPU_SOURCE
        decision = npu_verdict(v070.replace(TRAINING_GATHER, "pass"))
        verdict, reason = decision.verdict, decision.reason
        assert verdict is Verdict.FIXED_UPSTREAM and decision.shape == "verl0.7.0-top-k-experts", reason

    def test_experts_reading_some_other_way_are_unrecognized(self):
        """Refactored experts: neither the 0.7.1 gather nor the 0.7.0 pass-through. Not "fixed upstream"."""
        other = NPU_SOURCE.replace(TRAINING_GATHER, "selected_probs = routing_weights.gather(1, router_indices)")
        assert other != NPU_SOURCE
        assert npu_verdict(other).verdict is Verdict.UNRECOGNIZED

    def test_renamed_block_is_unrecognized(self):
        renamed = NPU_SOURCE.replace("class NPUQwen3VLMoeTextSparseMoeBlock", "class Renamed")
        assert npu_verdict(renamed).verdict is Verdict.UNRECOGNIZED


BLOCK, EXPERTS = "NPUQwen3VLMoeTextSparseMoeBlock", "NPUQwen3VLMoeTextExperts"
BLOCK_EXTRA_ARGUMENT = Variant(
    "extra argument to the block", NPU_PATCH, in_method(BLOCK, "forward", extra_parameter("padding_mask"))
)
NEAR_MISSES = [
    NearMisses(
        routing.PATCH.name,
        NPU_PATCH,
        "verl0.8-scatters",
        (
            Variant("scatter not in place", NPU_PATCH, in_method(BLOCK, "forward", scatter_not_in_place)),
            # The scatter guarded as in verl 0.7.1, with experts that read the dense matrix: the patch's case.
            Variant(
                "scatter under a conditional expression",
                NPU_PATCH,
                in_method(BLOCK, "forward", scatter_unless_training),
            ),
            Variant("scatter only in eval", NPU_PATCH, in_method(BLOCK, "forward", guard_scatter), APPLY),
            BLOCK_EXTRA_ARGUMENT,
            Variant(
                "extra argument to the experts",
                NPU_PATCH,
                in_method(EXPERTS, "forward", extra_parameter("expert_mask")),
            ),
        ),
    ),
    NearMisses(
        routing.PATCH.name,
        NPU_PATCH,
        "verl0.7.0-top-k-experts",
        (
            Variant(
                "unpermuted with another weight", NPU_PATCH, in_method(EXPERTS, "forward", unpermute_with_float_weights)
            ),
            Variant(
                "experts also read the dense matrix",
                NPU_PATCH,
                prepend_to(EXPERTS, "forward", "picked = routing_weights[batch_idx, router_indices]"),
            ),
            BLOCK_EXTRA_ARGUMENT,
        ),
    ),
]


@pytest.mark.fake_npu
@pytest.mark.parametrize(("patch", "target", "variant"), near_miss_cases(NEAR_MISSES))
def test_near_miss_of_a_safe_shape_is_not_called_safe(monkeypatch, patch, target, variant):
    check_near_miss(monkeypatch, patch, target, variant)
