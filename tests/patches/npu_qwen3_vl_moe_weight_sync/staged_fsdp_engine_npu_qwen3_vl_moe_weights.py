"""The FSDP engine's weight stream for the rollout (``FSDPEngine.get_per_tensor_param``) of a Qwen3-VL-MoE model
built with verl's Ascend block (``verl/models/transformers/npu_patch.py``) is tensor for tensor the stream of
transformers' own model holding the same weights: the per-expert ``gate_proj``, ``up_proj`` and ``down_proj`` that
vLLM-Ascend loads.

verl's NPU experts keep transformers 4.57's packing, ``gate_up_proj`` (E, H, 2I) and ``down_proj`` (E, I, H), while
``unfuse_moe_params`` splits transformers 5's, (E, 2I, H) and (E, H, I). Before the fix the rollout got the NPU
experts cut along the wrong axis: ``gate_proj`` of shape (H / 2, 2I) where H != 2I (the first case), or, where H == 2I
(the second), the right shapes holding scrambled values.

verl's NPU module imports ``torch_npu``; building the block calls none of its ops, so a bare stand-in module serves on
the CPU. ``get_per_tensor_param`` runs on a tiny model, unwrapped (the split does not depend on FSDP).
"""

import importlib
import importlib.util
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch
from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe
from verl.workers.engine.fsdp import transformer_impl

NPU_PATCH = "verl.models.transformers.npu_patch"
HIDDEN = 32
PACKED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


@pytest.fixture
def npu_patch(monkeypatch):
    """verl's NPU module under its own name, freshly loaded over a stand-in ``torch_npu`` (the weight sync looks it up
    in ``sys.modules``), which is removed again when the test ends, as is what ``_patch_qwen3_vl_moe`` rebinds in
    transformers."""
    monkeypatch.setitem(sys.modules, "torch_npu", ModuleType("torch_npu"))
    for name, value in list(vars(modeling_qwen3_vl_moe).items()):
        monkeypatch.setattr(modeling_qwen3_vl_moe, name, value)
        if isinstance(value, type) and value.__module__ == modeling_qwen3_vl_moe.__name__ and "forward" in vars(value):
            monkeypatch.setattr(value, "forward", vars(value)["forward"])
    spec = importlib.util.find_spec(NPU_PATCH)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, NPU_PATCH, module)
    spec.loader.exec_module(module)
    return module


def tiny_model(intermediate: int) -> Qwen3VLMoeForConditionalGeneration:
    text = dict(
        vocab_size=64,
        hidden_size=HIDDEN,
        intermediate_size=64,
        moe_intermediate_size=intermediate,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
    )
    vision = dict(
        depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=HIDDEN, deepstack_visual_indexes=[0]
    )
    return Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(text_config=text, vision_config=vision))


def weight_stream(model) -> dict[str, torch.Tensor]:
    engine = SimpleNamespace(
        module=model,
        model_config=SimpleNamespace(hf_config=model.config, lora={}),
        _uses_fsdp2_cpu_offload_policy=True,  # no move to the accelerator
        _is_offload_param=False,
        _qat_enabled=False,
    )
    weights, peft_config = transformer_impl.FSDPEngine.get_per_tensor_param(engine)
    assert peft_config is None
    return dict(weights)


@pytest.mark.parametrize("intermediate", [24, HIDDEN // 2], ids=["hidden_ne_2i", "hidden_eq_2i"])
def test_npu_experts_stream_as_transformers_experts(monkeypatch, npu_patch, intermediate):
    monkeypatch.setattr(transformer_impl, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(transformer_impl, "log_gpu_memory_usage", lambda *args, **kwargs: None)
    torch.manual_seed(0)
    reference = tiny_model(intermediate)
    with torch.no_grad():  # distinct values everywhere: a swapped or transposed slice cannot match
        for param in reference.parameters():
            param.copy_(torch.randn_like(param))
    expected = weight_stream(reference)

    npu_patch._patch_qwen3_vl_moe()  # what apply_npu_patches does for this model on Ascend
    model = tiny_model(intermediate)
    assert type(model.model.language_model.layers[0].mlp) is npu_patch.NPUQwen3VLMoeTextSparseMoeBlock
    # The same weights in the NPU experts' layout: transformers 5 stores the per-expert transposes.
    model.load_state_dict(
        {
            name: value.transpose(1, 2) if name.endswith(PACKED) else value
            for name, value in reference.state_dict().items()
        }
    )
    sent = weight_stream(model)

    assert sent.keys() == expected.keys()
    assert any(name.endswith("layers.0.mlp.experts.3.gate_proj.weight") for name in sent)
    for name, tensor in expected.items():
        torch.testing.assert_close(
            sent[name], tensor, rtol=0, atol=0, msg=lambda detail, name=name: f"{name}: {detail}"
        )
