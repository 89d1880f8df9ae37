"""``npu_qwen3_vl_moe_weight_sync`` on verl's real Ascend ``npu_patch``, run on the CPU through reference ``torch_npu``
ops: what verl's FSDP engine streams to the rollout from the NPU model, against its stream of transformers' own
model, with the plugin's split and with verl's own (the control); and verl 0.9's shard export, which it reports.

verl's npu_patch rewires transformers' Qwen3 modules for the rest of the process, so this module runs in a pytest
process of its own (marker ``fake_npu``; see noxfile.py), with the ``npu`` fixture (``tests/npu_fixture.py``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.helpers import decide_text, source_text
from tests.npu_fixture import FSDP_ENGINE, INTERMEDIATES, SHARD_EXPORT, needs_sync, npu_model
from verl_qwen3vl_plugin.patches.npu_qwen3_vl_moe_weight_sync import spec as sync
from verl_qwen3vl_plugin.registry import Verdict
from verl_qwen3vl_plugin.selftest.moe_blocks import engine_weight_stream, on_the_cpu
from verl_qwen3vl_plugin.selftest.npu_qwen3_vl_moe import weight_sync_check

pytestmark = pytest.mark.fake_npu


@needs_sync
@pytest.mark.parametrize("case", list(INTERMEDIATES))
def test_weight_sync_sends_exactly_transformers_experts(npu, case):
    """verl's real ``FSDPEngine.get_per_tensor_param`` on the NPU model equals its stream of transformers' model."""
    check = weight_sync_check("sync", engine_weight_stream(npu_model(npu, case)), npu.streams[case])
    assert check.ok, check.detail


@needs_sync
@pytest.mark.parametrize("case", list(INTERMEDIATES))
def test_weight_sync_bug_without_plugin(npu, case, monkeypatch):
    """The control: with verl's own split the per-expert tensors are wrong, in shape or, when hidden == 2I, in value."""
    monkeypatch.setattr(npu.engine, "unfuse_moe_params", npu.verl_unfuse)
    actual, expected = engine_weight_stream(npu_model(npu, case)), npu.streams[case]
    check = weight_sync_check("sync", actual, expected)
    assert not check.ok
    gate = next(k for k in expected if k.endswith("experts.0.gate_proj.weight"))
    assert (actual[gate].shape == expected[gate].shape) is (case == "hidden_eq_2i"), check.detail


@needs_sync
def test_shard_export_sends_the_npu_layout_and_reads_unrecognized(npu):
    """verl 0.9's real ``get_per_tensor_param_shard`` sends the NPU experts' packed (E, H, 2I) tensor under
    transformers 5's name, where transformers 5's model has (E, 2I, H): what the delta checkpoint engine would load.
    The plugin cannot transpose a flat shard, so the verdict says so instead of "fine"."""
    from verl.workers.engine.fsdp import transformer_impl

    model = npu_model(npu, "hidden_ne_2i")
    engine = SimpleNamespace(module=model, _uses_fsdp2_cpu_offload_policy=True, _is_offload_param=False)
    with on_the_cpu(transformer_impl):
        stream, _ = transformer_impl.FSDPEngine.get_per_tensor_param_shard(engine)
        specs = {name: spec for name, _, spec in stream}
    name = next(n for n in specs if n.endswith("layers.0.mlp.experts.gate_up_proj"))
    hf_shape = tuple(npu.states["hidden_ne_2i"][name].shape)  # transformers 5's own model
    assert tuple(specs[name].full_shape) == (hf_shape[0], hf_shape[2], hf_shape[1]) != hf_shape
    decision = decide_text(sync.PATCH, SHARD_EXPORT, source_text(FSDP_ENGINE))
    assert decision.verdict is Verdict.UNRECOGNIZED, decision
    assert decision.shape == "shard-export-delta-checkpoint-engines-export" and "not patched" in decision.reason


def test_weight_sync_wrapper_passes_through_what_it_does_not_read(npu):
    """An ``unfuse_moe_params`` with a parameter the wrapper does not know (the fixture made transformers' module build
    verl's NPU block): it reads ``model_type`` by name and hands every argument on as given."""
    from verl_qwen3vl_plugin.patches.npu_qwen3_vl_moe_weight_sync.replacement import layout_aware

    seen = {}

    def unfuse(weights, model_type=None, *, layout="packed"):
        seen.update(model_type=model_type, layout=layout)
        return list(weights)

    tensor = torch.zeros(2, 3, 4)
    out = layout_aware(unfuse)(iter([("a.mlp.experts.down_proj", tensor)]), "qwen3_vl_moe", layout="split")
    assert seen == {"model_type": "qwen3_vl_moe", "layout": "split"}
    assert out[0][1].shape == (2, 4, 3)  # the NPU layout transposed to transformers 5's before verl's split
