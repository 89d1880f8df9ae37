"""``moe_per_expert_sync`` in effect: verl's own ``FSDPEngine.get_per_tensor_param`` on tiny Qwen3-VL-MoE and
Qwen3.5-MoE models, loaded into a test-only stand-in for vLLM 0.18.1's expert loading (``vllm_0_18_stand_in.py``,
written from its semantics), with the plugin's split and without it (the control); the hooks' wrapper in a user's
process, and with the patch disabled; and the split of verl's Ascend experts (``fake_npu``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import TRANSFORMERS, VERL, child_json, decide_text, source_text
from tests.patches.moe_per_expert_sync.vllm_0_18_stand_in import LayerExperts, load_experts
from verl_qwen3vl_plugin.patches import spec
from verl_qwen3vl_plugin.patches.moe_per_expert_sync.replacement import OUT_IN, packed_layout, per_expert
from verl_qwen3vl_plugin.patches.moe_per_expert_sync.selftest import experts_check, verl_stream
from verl_qwen3vl_plugin.registry import Verdict
from verl_qwen3vl_plugin.selftest.tiny_models import has_qwen3_5, randomize, tiny_qwen3_5, tiny_qwen3_vl_moe

HERE = Path(__file__).resolve().parent
PATCH = spec("moe_per_expert_sync")
TARGET = PATCH.targets[0]
DECISION = decide_text(PATCH, TARGET, source_text(TARGET.module))
APPLIES = DECISION.verdict is Verdict.APPLY
TF5 = TRANSFORMERS.release >= (5,)
INTERMEDIATES = {"hidden_ne_2i": 24, "hidden_eq_2i": 16}  # the tiny models' hidden size is 32
FAMILIES = ["Qwen3-VL-MoE", *(["Qwen3.5-MoE"] if has_qwen3_5() else [])]
needs_split = pytest.mark.skipif(not APPLIES, reason=f"the patch does not apply here: {DECISION.reason}")


def tiny(family: str, case: str) -> torch.nn.Module:
    build = tiny_qwen3_vl_moe if family == "Qwen3-VL-MoE" else lambda **text: tiny_qwen3_5(moe=True, **text)
    return randomize(build(moe_intermediate_size=INTERMEDIATES[case]), seed=1)


def experts_of(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {p.removesuffix(".mlp.experts"): m for p, m in model.named_modules() if p.endswith(".mlp.experts")}


def vllm_load(model: torch.nn.Module, sent: dict[str, torch.Tensor], family: str) -> dict[str, LayerExperts]:
    text = model.config.get_text_config()
    layers = {
        p: LayerExperts(text.num_experts, text.hidden_size, text.moe_intermediate_size) for p in experts_of(model)
    }
    load_experts(layers, sent.items(), transposes_packed=family == "Qwen3-VL-MoE")
    return layers


def loaded_exactly(model: torch.nn.Module, layers: dict[str, LayerExperts]) -> bool:
    """vLLM's w13 / w2 are transformers 5's gate_up_proj / down_proj, expert by expert."""
    return all(
        torch.equal(layers[p].w13, m.gate_up_proj.detach()) and torch.equal(layers[p].w2, m.down_proj.detach())
        for p, m in experts_of(model).items()
    )


@pytest.mark.skipif(not TF5, reason="transformers 4.57 packs as the checkpoint does")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", list(INTERMEDIATES))
def test_sync_loads_every_expert_exactly(family, case):
    """What this verl sends with the plugin (its own stream where verl 0.9 splits it) loads exactly."""
    model = tiny(family, case)
    sent = verl_stream(model, split=APPLIES)
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in sent)
    assert loaded_exactly(model, vllm_load(model, sent, family))
    check = experts_check("sync", model, sent)
    assert check.ok, check.detail


@needs_split
def test_packed_sync_is_rejected_or_scrambled_without_plugin():
    """The control: verl 0.8's own stream. Where hidden != 2I the packed gate_up_proj is rejected; where hidden == 2I
    it loads without an error into scrambled gate and up projections, and the down_proj after it is rejected."""
    model = tiny("Qwen3-VL-MoE", "hidden_ne_2i")
    with pytest.raises(RuntimeError):
        vllm_load(model, verl_stream(model, split=False), "Qwen3-VL-MoE")

    model = tiny("Qwen3-VL-MoE", "hidden_eq_2i")
    sent = verl_stream(model, split=False)
    gate_up = {k: t for k, t in sent.items() if k.endswith("experts.gate_up_proj")}
    layers = vllm_load(model, gate_up, "Qwen3-VL-MoE")
    for prefix, experts in experts_of(model).items():
        assert layers[prefix].w13.shape == experts.gate_up_proj.shape
        assert not torch.equal(layers[prefix].w13, experts.gate_up_proj.detach())
    with pytest.raises(RuntimeError):
        vllm_load(model, sent, "Qwen3-VL-MoE")


@needs_split
@pytest.mark.parametrize("disable", [False, True])
def test_hooks_wrap_verls_engine_in_a_users_process(disable):
    """The start-up hook wraps ``FSDPEngine.get_per_tensor_param``; ``VERL_QWEN3VL_PLUGIN_DISABLE`` leaves verl's."""
    env = {"VERL_QWEN3VL_PLUGIN_DISABLE": PATCH.name} if disable else None
    keys = child_json(HERE / "engine_stream.py", env=env)["keys"]
    packed = [
        "model.language_model.layers.0.mlp.experts.down_proj",
        "model.language_model.layers.0.mlp.experts.gate_up_proj",
    ]
    assert (keys == packed) is disable, keys[:4]


def test_a_split_stream_passes_unchanged():
    """A stream already per expert (verl 0.9's) goes through the split untouched: nothing is split twice."""
    stream = [
        ("a.mlp.experts.0.gate_proj.weight", torch.ones(2, 3)),
        ("a.mlp.experts.0.down_proj.weight", torch.ones(3, 2)),
    ]
    assert list(per_expert(iter(stream), OUT_IN)) == stream


def test_unknown_experts_class_raises():
    """Packed experts of a class with no known layout: an error, not a guess."""

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(2, 4, 4))

    with pytest.raises(RuntimeError, match="no known layout"):
        packed_layout(torch.nn.Sequential(Experts()), {})


@pytest.mark.fake_npu
@needs_split
@pytest.mark.parametrize("case", list(INTERMEDIATES))
def test_npu_experts_sent_as_transformers_own(npu, case):
    """verl 0.8's Ascend block (E, H, 2I) sends, through the plugin, exactly the per-expert tensors transformers'
    own model with the same weights gives (the ``npu`` fixture: verl's real npu_patch on CPU reference ops)."""
    from tests.npu_fixture import npu_model

    nm = npu_model(npu, case)
    assert packed_layout(nm, {("verl.models.transformers.npu_patch", "NPUQwen3VLMoeTextExperts"): "in_out"}) == "in_out"
    sent = verl_stream(nm, split=True)
    expected = dict(per_expert(npu.states[case].items(), OUT_IN))
    assert sent.keys() == expected.keys()
    assert all(torch.equal(sent[k], expected[k]) for k in expected)
    assert VERL.release < (0, 9)
