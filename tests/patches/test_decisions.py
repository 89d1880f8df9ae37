"""Each patch's decision, read from the installed upstream code and from synthesized sources, through
``registry.decide`` (what the hooks and the doctor both call). Fail closed: a shape no probe knows is
``unrecognized``, is not patched by the real hook, and is logged at WARNING."""

from __future__ import annotations

import pytest

from tests.helpers import POS_EMBED_USED, VERL, child_json, judge, last_json, run_child, source_text, use_sources
from verl_qwen3vl_plugin import environment
from verl_qwen3vl_plugin.environment import parse
from verl_qwen3vl_plugin.patches import NAMES
from verl_qwen3vl_plugin.patches.npu_qwen3_vl_moe_routing import spec as npu_qwen3_vl_moe_routing
from verl_qwen3vl_plugin.patches.npu_qwen3_vl_moe_weight_sync import spec as npu_qwen3_vl_moe_weight_sync
from verl_qwen3vl_plugin.patches.qwen3_vl_pos_embed import spec as qwen3_vl_pos_embed
from verl_qwen3vl_plugin.registry import Decision, Verdict, decide, disable_list

NPU_PATCH = "verl.models.transformers.npu_patch"
NPU = npu_qwen3_vl_moe_routing.PATCH
NPU_BLOCK = NPU.target(NPU_PATCH)
POS = qwen3_vl_pos_embed.PATCH
NPU_SOURCE = source_text(NPU_PATCH)
VISION = POS.target("transformers.models.qwen3_vl.modeling_qwen3_vl")
VISION_SOURCE = source_text(VISION.module)
GUARD = "        if not self.training:\n            routing_weights = torch.zeros_like"
TRAINING_GATHER = "selected_probs = routing_weights[batch_idx, router_indices]"


def npu_verdict(source: str | None) -> Decision:
    return judge(NPU, NPU_BLOCK, source)


def test_installed_verl_npu_decision():
    decision = npu_verdict(NPU_SOURCE)
    verdict, reason = decision.verdict, decision.reason
    assert verdict is (Verdict.APPLY if VERL.release == (0, 7, 1) else Verdict.FIXED_UPSTREAM), reason


def test_installed_transformers_pos_embed_decision():
    for target in (VISION, POS.target("transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe")):
        decision = judge(POS, target, source_text(target.module))
        verdict, reason = decision.verdict, decision.reason
        assert verdict is (Verdict.APPLY if POS_EMBED_USED else Verdict.NOT_USED), reason


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


@pytest.mark.parametrize("source", [None, "def broken(:\n"], ids=["missing", "unparsable"])
def test_missing_or_unparsable_source_is_unrecognized(source):
    assert npu_verdict(source).verdict is Verdict.UNRECOGNIZED
    assert judge(POS, VISION, source).verdict is Verdict.UNRECOGNIZED


def test_unreadable_source_is_unrecognized(monkeypatch, tmp_path):
    """A file that exists but cannot be read as UTF-8: the hooks' own read path, not a synthesized Source."""
    bad = tmp_path / "bad.py"
    bad.write_bytes(b"\xff\xfe not utf-8")
    monkeypatch.setattr(environment, "module_path", lambda name: bad)
    environment.source_of.cache_clear()
    try:
        source = environment.source_of(NPU_PATCH)
    finally:
        environment.source_of.cache_clear()
    assert source.tree is None and source.problem.startswith("cannot be read")
    assert decide(NPU, NPU_BLOCK, source, frozenset()).verdict is Verdict.UNRECOGNIZED


SYNTH_NPU = """
class NPUQwen3VLMoeTextExperts:
    def forward(self, hidden_states, routing_weights, router_indices):
        return hidden_states * routing_weights.sum()


class NPUQwen3VLMoeTextSparseMoeBlock:
    def forward(self, hidden_states):
        return self.experts(hidden_states, self.route(hidden_states), None)
"""
SYNTH_VISION = """
class Qwen3VLVisionModel:
    def fast_pos_embed_interpolate(self, grid_thw):
        return grid_thw

    def forward(self, hidden_states, grid_thw, **kwargs):
        return hidden_states + self.position_table(grid_thw)
"""
VISION_KNOWN_FIXED = "from ...vision_utils import get_vision_bilinear_indices_and_weights\n" + SYNTH_VISION.replace(
    "self.position_table(grid_thw)", "get_vision_bilinear_indices_and_weights(grid_thw)"
)
VISION_KNOWN_FIXED_5_16 = VISION_KNOWN_FIXED.replace(
    "get_vision_bilinear_indices_and_weights", "get_vision_interpolation_indices_and_weights"
)
VISION_AFFECTED = SYNTH_VISION.replace("self.position_table(grid_thw)", "self.fast_pos_embed_interpolate(grid_thw)")


def test_synthesized_vision_sources():
    assert judge(POS, VISION, SYNTH_VISION).verdict is Verdict.UNRECOGNIZED
    assert judge(POS, VISION, VISION_KNOWN_FIXED).verdict is Verdict.NOT_USED
    assert judge(POS, VISION, VISION_KNOWN_FIXED_5_16).shape == "tf5.16-vision-utils-interpolation"
    assert judge(POS, VISION, VISION_AFFECTED).verdict is Verdict.APPLY
    wrong_signature = VISION_AFFECTED.replace("(self, grid_thw):", "(self, grid_thw, scale):")
    assert judge(POS, VISION, wrong_signature).verdict is Verdict.UNRECOGNIZED


def test_synthesized_monkey_patch_sources():
    target = POS.target("verl.models.transformers.monkey_patch")
    assert judge(POS, target, "def other():\n    pass\n").verdict is Verdict.UNRECOGNIZED
    # verl 0.7 sets none; the wrapper, which only puts the plugin's back afterwards, is right there too.
    assert judge(POS, target, "def apply_monkey_patch(model):\n    pass\n").verdict is Verdict.APPLY
    sets = "def apply_monkey_patch(model):\n    Qwen3VLVisionModel.fast_pos_embed_interpolate = f\n"
    assert judge(POS, target, sets).verdict is Verdict.APPLY


@pytest.mark.parametrize(
    ("module", "source", "cls", "attribute"),
    [
        (NPU_PATCH, SYNTH_NPU, "NPUQwen3VLMoeTextSparseMoeBlock", "forward"),
        (VISION.module, SYNTH_VISION, "Qwen3VLVisionModel", "fast_pos_embed_interpolate"),
    ],
    ids=["npu_block", "vision"],
)
def test_real_hook_on_unrecognized_upstream_does_not_patch_and_warns(tmp_path, module, source, cls, attribute):
    path = tmp_path / "synthesized.py"
    path.write_text(source)
    patch = next(p for p in (NPU, POS) if any(t.module == module for t in p.targets)).name
    proc = run_child("synthesized_target.py", patch, module, str(path), cls, attribute)
    result = last_json(proc)
    assert result["status"] == "unrecognized" and not result["replaced"], result
    # A WARNING (it reaches stderr at verl's default level) where the patch concerns this machine; the NPU patch
    # on this NPU-less machine logs INFO: verl imports some of its targets on every machine.
    warned = f"on {module} unrecognized" in proc.stderr
    assert warned is (patch != NPU.name), proc.stderr[-2000:]


def test_real_hook_on_affected_synthesized_upstream_patches(tmp_path):
    """The control for the test above: the same harness patches a source in the known-affected shape."""
    path = tmp_path / "synthesized.py"
    path.write_text(VISION_AFFECTED)
    args = (POS.name, VISION.module, str(path), "Qwen3VLVisionModel", "fast_pos_embed_interpolate")
    result = child_json("synthesized_target.py", *args)
    assert result["status"] == "applied" and result["replaced"], result


def test_disabled_comes_from_the_environment_given(monkeypatch):
    """``decide`` reads no environment: the disabled set handed to it decides, as the hooks and the doctor pass it."""
    monkeypatch.setenv("VERL_QWEN3VL_PLUGIN_DISABLE", "all")  # this process's: must not count
    disabled, _ = disable_list(NAMES, {"VERL_QWEN3VL_PLUGIN_DISABLE": "npu_qwen3_vl_moe_routing"})
    assert decide(NPU, NPU_BLOCK, parse(NPU_SOURCE), disabled).verdict is Verdict.DISABLED
    assert decide(POS, VISION, parse(VISION_SOURCE), disabled).verdict is not Verdict.DISABLED


SYNC = npu_qwen3_vl_moe_weight_sync.PATCH
FSDP_UTILS, FSDP_ENGINE = "verl.workers.engine.fsdp.utils", "verl.workers.engine.fsdp.transformer_impl"
SYNC_UTILS = SYNC.target(FSDP_UTILS)
UTILS_SOURCE = source_text(FSDP_UTILS)
SYNCS = VERL.release >= (0, 9)


def test_installed_verl_weight_sync_decision():
    labels = (FSDP_UTILS, FSDP_ENGINE, f"{FSDP_ENGINE}:FSDPEngine.get_per_tensor_param_shard")
    utils, caller, shard_export = (judge(SYNC, t, source_text(t.module)) for t in map(SYNC.target, labels))
    for decision in (utils, caller):
        assert decision.verdict is (Verdict.APPLY if SYNCS else Verdict.NOT_USED), decision.reason
    # verl 0.9's shard export sends the NPU layout as stored: reported, not patched.
    assert shard_export.verdict is (Verdict.UNRECOGNIZED if SYNCS else Verdict.NOT_USED), shard_export.reason


@pytest.mark.skipif(not SYNCS, reason="edits of verl 0.9's unfuse_moe_params")
class TestEditedWeightSyncSources:
    def test_a_split_along_another_axis_is_unrecognized(self):
        edited = UTILS_SOURCE.replace("tensor.chunk(2, dim=1)", "tensor.chunk(2, dim=2)")
        assert edited != UTILS_SOURCE
        assert judge(SYNC, SYNC_UTILS, edited).verdict is Verdict.UNRECOGNIZED

    def test_npu_experts_in_transformers5_layout_are_fixed_upstream(self, monkeypatch):
        npu = NPU_SOURCE.replace(
            "torch.empty(self.num_experts, self.hidden_size, 2 * self.expert_dim)",
            "torch.empty(self.num_experts, 2 * self.expert_dim, self.hidden_size)",
        )
        assert npu != NPU_SOURCE
        use_sources(monkeypatch, {NPU_PATCH: npu})
        decision = judge(SYNC, SYNC_UTILS, UTILS_SOURCE)
        verdict, reason = decision.verdict, decision.reason
        assert verdict is Verdict.FIXED_UPSTREAM and decision.shape == "npu-experts-tf5-layout", reason

    def test_npu_experts_built_some_other_way_are_unrecognized(self, monkeypatch):
        npu = NPU_SOURCE.replace("torch.empty(self.num_experts, self.hidden_size, 2 * self.expert_dim)", "make()")
        assert npu != NPU_SOURCE
        use_sources(monkeypatch, {NPU_PATCH: npu})
        assert judge(SYNC, SYNC_UTILS, UTILS_SOURCE).verdict is Verdict.UNRECOGNIZED
