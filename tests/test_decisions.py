"""What ``registry.decide`` (what the hooks and the doctor both call) does for every patch, shown on two of them:
fail closed. A missing, unparsable or unreadable source, or a shape no probe knows, is ``unrecognized``, is not patched
by the real hook, and is logged at WARNING; the disabled set is the one handed in. Each patch's own decisions are in
its ``tests/patches/<name>/test_probes.py``."""

from __future__ import annotations

import pytest

from tests.helpers import child_json, decide_text, last_json, run_child, source_text
from tests.patches.qwen3_vl_pos_embed.test_probes import SYNTH_VISION, VISION_AFFECTED
from verl_qwen3vl_plugin import environment
from verl_qwen3vl_plugin.environment import parse
from verl_qwen3vl_plugin.patches import NAMES
from verl_qwen3vl_plugin.patches.npu_qwen3_vl_moe_routing import spec as npu_qwen3_vl_moe_routing
from verl_qwen3vl_plugin.patches.qwen3_vl_pos_embed import spec as qwen3_vl_pos_embed
from verl_qwen3vl_plugin.registry import Decision, Verdict, decide, disable_list

NPU_PATCH = "verl.models.transformers.npu_patch"
NPU = npu_qwen3_vl_moe_routing.PATCH
NPU_BLOCK = NPU.target(NPU_PATCH)
POS = qwen3_vl_pos_embed.PATCH
NPU_SOURCE = source_text(NPU_PATCH)
VISION = POS.target("transformers.models.qwen3_vl.modeling_qwen3_vl")
VISION_SOURCE = source_text(VISION.module)


def npu_verdict(source: str | None) -> Decision:
    return decide_text(NPU, NPU_BLOCK, source)


@pytest.mark.parametrize("source", [None, "def broken(:\n"], ids=["missing", "unparsable"])
def test_missing_or_unparsable_source_is_unrecognized(source):
    assert npu_verdict(source).verdict is Verdict.UNRECOGNIZED
    assert decide_text(POS, VISION, source).verdict is Verdict.UNRECOGNIZED


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
