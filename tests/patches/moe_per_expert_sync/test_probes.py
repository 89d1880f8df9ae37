"""``moe_per_expert_sync``: its decision on the installed verl and transformers, through ``registry.decide`` (what the
hooks and the doctor both call), and near-misses of the shapes its probe calls safe (``tests/source_edits.py``). The
stream itself is tested in ``test_weight_sync.py``."""

from __future__ import annotations

import pytest

from tests.helpers import TRANSFORMERS, VERL, decide_text, source_text, use_sources
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
    replace,
)
from verl_qwen3vl_plugin.families import QWEN3_VL_MOE
from verl_qwen3vl_plugin.patches import spec
from verl_qwen3vl_plugin.registry import Verdict
from verl_qwen3vl_plugin.upstream import FSDP_ENGINE, FSDP_ENGINE_UTILS, NPU_PATCH

PATCH = spec("moe_per_expert_sync")
TARGET = PATCH.targets[0]
ENGINE_SOURCE = source_text(FSDP_ENGINE)
METHOD = ("FSDPEngine", "get_per_tensor_param")


def test_installed_decision():
    """verl 0.9 splits itself; verl 0.8 with transformers 5 sends packed experts; transformers 4.57 packs as the
    checkpoint does."""
    decision = decide_text(PATCH, TARGET, ENGINE_SOURCE)
    if VERL.release >= (0, 9):
        expected = Verdict.FIXED_UPSTREAM
    else:
        expected = Verdict.APPLY if TRANSFORMERS.release >= (5,) else Verdict.NOT_USED
    assert decision.verdict is expected, decision.reason


@pytest.mark.skipif(VERL.release >= (0, 9) or TRANSFORMERS.release < (5,), reason="verl 0.8's stream, transformers 5")
class TestEditedExperts:
    def test_npu_experts_built_another_way_are_unrecognized(self, monkeypatch):
        npu = source_text(NPU_PATCH)
        edited = npu.replace("torch.empty(self.num_experts, self.hidden_size, 2 * self.expert_dim)", "make()")
        assert edited != npu
        use_sources(monkeypatch, {NPU_PATCH: edited})
        assert decide_text(PATCH, TARGET, ENGINE_SOURCE).verdict is Verdict.UNRECOGNIZED

    def test_without_verls_npu_patch_it_still_applies(self, monkeypatch):
        use_sources(monkeypatch, {NPU_PATCH: None})
        assert decide_text(PATCH, TARGET, ENGINE_SOURCE).verdict is Verdict.APPLY

    def test_transformers_experts_built_another_way_are_unrecognized(self, monkeypatch):
        modeling = source_text(QWEN3_VL_MOE.modeling)
        edited = modeling.replace(
            "2 * self.intermediate_dim, self.hidden_dim", "self.hidden_dim, 2 * self.intermediate_dim"
        )
        assert edited != modeling
        use_sources(monkeypatch, {QWEN3_VL_MOE.modeling: edited})
        assert decide_text(PATCH, TARGET, ENGINE_SOURCE).verdict is Verdict.UNRECOGNIZED


SHARED = (  # near-misses of every safe shape: the stream no longer as the shape has it
    Variant("keys renamed", FSDP_ENGINE, in_method(*METHOD, rename_stream_keys)),
    Variant(
        "a subclass sends its own stream",
        FSDP_ENGINE,
        in_class(
            "FSDPEngineWithLMHead",
            add_method("def get_per_tensor_param(self, **kwargs):\n    return (iter(()), None)"),
        ),
    ),
)
NEAR_MISSES = [
    NearMisses(
        PATCH.name,
        TARGET.label,
        "verl0.9-unfuses-moe-params",
        (
            *SHARED,
            Variant(
                "split twice",
                FSDP_ENGINE,
                in_method(*METHOD, before_return("per_tensor_param = unfuse_moe_params(per_tensor_param, 'x')")),
            ),
            Variant("split into other keys", FSDP_ENGINE_UTILS, replace(".gate_proj.weight", ".w1")),
        ),
    ),
    NearMisses(
        PATCH.name,
        TARGET.label,
        "tf4.57-experts-in-checkpoint-layout",
        (
            *SHARED,
            Variant(
                "experts built some other way",
                QWEN3_VL_MOE.modeling,
                replace("torch.empty(self.num_experts, self.hidden_size, 2 * self.expert_dim)", "make()"),
            ),
            Variant(
                "experts packed as transformers 5 packs them",
                QWEN3_VL_MOE.modeling,
                replace(
                    "torch.empty(self.num_experts, self.hidden_size, 2 * self.expert_dim)",
                    "torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim)",
                ),
                # the down_proj left in 4.57's form: the pair matches no known packing
            ),
        ),
    ),
]


@pytest.mark.parametrize(("patch", "target", "variant"), near_miss_cases(NEAR_MISSES))
def test_near_miss_of_a_safe_shape_is_not_called_safe(monkeypatch, patch, target, variant):
    check_near_miss(monkeypatch, patch, target, variant)
