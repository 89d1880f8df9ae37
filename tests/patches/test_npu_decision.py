"""The NPU patch's decision, read from the installed verl's real ``npu_patch.py`` (and edits of it that reproduce
the shapes of verl 0.7.0 and >= 0.8), without importing it."""

from __future__ import annotations

import pytest

from tests.conftest import VERL
from verl_qwen3vl_plugin.compat import module_source
from verl_qwen3vl_plugin.patches.npu_qwen3_vl_moe import TARGET, decide_installed, decide_source
from verl_qwen3vl_plugin.registry import Status

SOURCE = module_source(TARGET)
AFFECTED = VERL.release == (0, 7, 1)
GUARD = "        if not self.training:\n            routing_weights = torch.zeros_like"
TRAINING_GATHER = "selected_probs = routing_weights[batch_idx, router_indices]"


def test_installed_verl_decision():
    status, reason = decide_installed()
    assert status is (Status.APPLIED if AFFECTED else Status.FIXED_UPSTREAM), reason
    assert str(VERL) in reason


@pytest.mark.skipif(not AFFECTED, reason="edits of verl 0.7.1's source")
class TestEditedSource:
    def test_always_scattering_block_is_fixed_upstream(self):
        fixed = SOURCE.replace(GUARD, "        routing_weights = torch.zeros_like")
        assert fixed != SOURCE
        status, reason = decide_source(fixed)
        assert status is Status.FIXED_UPSTREAM and "scatters routing weights in every mode" in reason

    def test_experts_taking_top_k_weights_have_no_mismatch(self):
        """verl 0.7.0: the training path passes the top-k weights straight to unpermute."""
        v070 = SOURCE.replace(TRAINING_GATHER, "selected_probs = routing_weights")
        assert v070 != SOURCE
        status, reason = decide_source(v070)
        assert status is Status.FIXED_UPSTREAM and "takes the top-k weights directly" in reason

    def test_without_the_block_it_is_not_used(self):
        status, _ = decide_source(SOURCE.replace("class NPUQwen3VLMoeTextSparseMoeBlock", "class Renamed"))
        assert status is Status.NOT_USED

    def test_unreadable_source_falls_back_to_the_version(self):
        status, reason = decide_source(None)
        assert status is Status.APPLIED and "source unreadable" in reason


def test_disabled(monkeypatch):
    monkeypatch.setenv("VERL_QWEN3VL_PLUGIN_DISABLE", "npu_qwen3_vl_moe_routing")
    assert decide_installed()[0] is Status.DISABLED
