"""``npu_qwen3_vl_moe_weight_sync``: its decisions on the installed verl and on edits of verl 0.9's
``unfuse_moe_params`` and of the NPU experts, through ``registry.decide`` (what the hooks and the doctor both call),
and near-misses of the verl shapes its probes call safe (``tests/source_edits.py``). The stream itself is tested in
``test_weight_sync.py``."""

from __future__ import annotations

import pytest

from tests.helpers import VERL, decide_text, source_text, use_sources
from tests.npu_fixture import FSDP_ENGINE, FSDP_UTILS, NPU_PATCH, SHARD_EXPORT, SYNC_ENGINE, SYNC_UTILS, needs_sync
from tests.source_edits import (
    NearMisses,
    Variant,
    add_method,
    before_return,
    check_near_miss,
    in_class,
    in_method,
    near_miss_cases,
    rename_stream_keys,
    substitute,
)
from verl_qwen3vl_plugin.patches.npu_qwen3_vl_moe_weight_sync import spec as sync
from verl_qwen3vl_plugin.registry import Verdict

SYNC = sync.PATCH
UTILS_SOURCE = source_text(FSDP_UTILS)
NPU_SOURCE = source_text(NPU_PATCH)
UNFUSES = VERL.release >= (0, 9)  # verl 0.9 splits the packed experts in unfuse_moe_params, which the patch wraps


def test_installed_verl_weight_sync_decision():
    labels = (FSDP_UTILS, FSDP_ENGINE, f"{FSDP_ENGINE}:FSDPEngine.get_per_tensor_param_shard")
    utils, caller, shard_export = (decide_text(SYNC, t, source_text(t.module)) for t in map(SYNC.target, labels))
    for decision in (utils, caller):
        assert decision.verdict is (Verdict.APPLY if UNFUSES else Verdict.NOT_USED), decision.reason
    # verl 0.9's shard export sends the NPU layout as stored: reported, not patched.
    assert shard_export.verdict is (Verdict.UNRECOGNIZED if UNFUSES else Verdict.NOT_USED), shard_export.reason


@pytest.mark.skipif(not UNFUSES, reason="edits of verl 0.9's unfuse_moe_params")
class TestEditedWeightSyncSources:
    def test_a_split_along_another_axis_is_unrecognized(self):
        edited = UTILS_SOURCE.replace("tensor.chunk(2, dim=1)", "tensor.chunk(2, dim=2)")
        assert edited != UTILS_SOURCE
        assert decide_text(SYNC, SYNC_UTILS, edited).verdict is Verdict.UNRECOGNIZED

    def test_npu_experts_in_transformers5_layout_are_fixed_upstream(self, monkeypatch):
        npu = NPU_SOURCE.replace(
            "torch.empty(self.num_experts, self.hidden_size, 2 * self.expert_dim)",
            "torch.empty(self.num_experts, 2 * self.expert_dim, self.hidden_size)",
        )
        assert npu != NPU_SOURCE
        use_sources(monkeypatch, {NPU_PATCH: npu})
        decision = decide_text(SYNC, SYNC_UTILS, UTILS_SOURCE)
        verdict, reason = decision.verdict, decision.reason
        assert verdict is Verdict.FIXED_UPSTREAM and decision.shape == "npu-experts-tf5-layout", reason

    def test_npu_experts_built_some_other_way_are_unrecognized(self, monkeypatch):
        npu = NPU_SOURCE.replace("torch.empty(self.num_experts, self.hidden_size, 2 * self.expert_dim)", "make()")
        assert npu != NPU_SOURCE
        use_sources(monkeypatch, {NPU_PATCH: npu})
        assert decide_text(SYNC, SYNC_UTILS, UTILS_SOURCE).verdict is Verdict.UNRECOGNIZED


@pytest.mark.fake_npu
@needs_sync
def test_an_extra_parameter_of_verls_split_still_applies():
    """The probe checks what the wrapper relies on (``weights`` first, a ``model_type``), not the whole signature."""
    old = "def unfuse_moe_params(weights, model_type: str | None = None):"
    assert old in UTILS_SOURCE
    edited = UTILS_SOURCE.replace(
        old, "def unfuse_moe_params(weights, model_type: str | None = None, *, layout='packed'):"
    )
    assert decide_text(SYNC, SYNC_UTILS, edited).verdict is Verdict.APPLY
    without = UTILS_SOURCE.replace(old, "def unfuse_moe_params(weights, kind: str | None = None):")
    assert decide_text(SYNC, SYNC_UTILS, without).verdict is Verdict.UNRECOGNIZED


FULL = ("FSDPEngine", "get_per_tensor_param")  # the full export, which streams every parameter
STORED_STREAM = (  # near-misses of verl 0.7/0.8's stream, its packed experts as stored
    Variant(
        "split by a helper of another name",
        FSDP_ENGINE,
        in_method(*FULL, before_return("per_tensor_param = split_experts(per_tensor_param)")),
    ),
    Variant("keys renamed", FSDP_ENGINE, in_method(*FULL, rename_stream_keys)),
    Variant(
        "unfused, with no unfuse_moe_params to wrap",
        FSDP_ENGINE,
        in_method(*FULL, before_return("per_tensor_param = unfuse_moe_params(per_tensor_param, 'qwen3_vl_moe')")),
    ),
)
NEAR_MISSES = [
    *(NearMisses(SYNC.name, t.label, "verl0.8-sends-as-stored", STORED_STREAM) for t in (SYNC_UTILS, SYNC_ENGINE)),
    NearMisses(
        SYNC.name,
        SHARD_EXPORT.label,
        "verl0.8-no-shard-export",
        (
            Variant(
                "another method reads the state dict",
                FSDP_ENGINE,
                in_class("FSDPEngine", add_method("def export_shards(self):\n    return self.module.state_dict()")),
            ),
            Variant(
                "a method reads it through another function",
                FSDP_ENGINE,
                in_class(
                    "FSDPEngine", add_method("def export_shards(self):\n    return get_model_state_dict(self.module)")
                ),
            ),
            Variant(
                "a shard export on another class",
                FSDP_ENGINE,
                in_class(
                    "FSDPEngineWithLMHead", add_method("def get_per_tensor_param_shard(self):\n    return iter(())")
                ),
            ),
            Variant(
                "renamed full export", FSDP_ENGINE, substitute(r"def get_per_tensor_param\(", "def export_weights(")
            ),
        ),
    ),
]


@pytest.mark.fake_npu
@pytest.mark.parametrize(("patch", "target", "variant"), near_miss_cases(NEAR_MISSES))
def test_near_miss_of_a_safe_shape_is_not_called_safe(monkeypatch, patch, target, variant):
    check_near_miss(monkeypatch, patch, target, variant)
