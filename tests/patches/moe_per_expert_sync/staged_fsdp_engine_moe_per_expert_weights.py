"""The FSDP engine's weight stream for the rollout sends a Qwen3-VL-MoE model's packed experts per expert, as the
checkpoint keys them (``experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``, each (out, in)): what every vLLM
release loads. transformers 5 packs them as ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I); vLLM's
Qwen3-VL-MoE loader up to 0.24 transposes packed tensors as if they were (E, H, 2I), which fails on a shape, or, where
H == 2I (the second case), loads scrambled gate and up projections. ``get_per_tensor_param`` runs on a tiny model on
the CPU, unwrapped (the stream's split does not depend on FSDP). Before the fix the packed tensors were sent."""

from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
from verl.workers.engine.fsdp import transformer_impl

HIDDEN, EXPERTS = 32, 4


def tiny_model(intermediate: int) -> Qwen3VLMoeForConditionalGeneration:
    text = dict(
        vocab_size=64,
        hidden_size=HIDDEN,
        intermediate_size=64,
        moe_intermediate_size=intermediate,
        num_experts=EXPERTS,
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
    torch.manual_seed(0)
    model = Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(text_config=text, vision_config=vision))
    for param in model.parameters():  # distinct values everywhere: a swapped or transposed slice cannot match
        param.data.copy_(torch.randn_like(param))
    return model


@pytest.mark.parametrize("intermediate", [24, HIDDEN // 2])
def test_weight_stream_sends_moe_experts_per_expert(monkeypatch, intermediate):
    monkeypatch.setattr(transformer_impl, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(transformer_impl, "log_gpu_memory_usage", lambda *args, **kwargs: None)
    model = tiny_model(intermediate)
    engine = SimpleNamespace(
        module=model,
        model_config=SimpleNamespace(hf_config=model.config, lora={}),
        _uses_fsdp2_cpu_offload_policy=True,  # no move to the accelerator
        _is_offload_param=False,
        _qat_enabled=False,
    )
    weights, peft_config = transformer_impl.FSDPEngine.get_per_tensor_param(engine)
    sent = dict(weights)

    assert peft_config is None
    packed = [name for name in sent if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]
    assert packed == [], "packed experts sent"
    blocks = [m for m in model.modules() if type(m).__name__ == "Qwen3VLMoeTextExperts"]
    assert len(blocks) == 2
    for layer, block in enumerate(blocks):
        for expert in range(EXPERTS):

            def key(projection: str, layer: int = layer, expert: int = expert) -> str:
                suffix = f"layers.{layer}.mlp.experts.{expert}.{projection}.weight"
                (name,) = [name for name in sent if name.endswith(suffix)]
                return name

            gate_up = block.gate_up_proj[expert].detach()
            torch.testing.assert_close(sent[key("gate_proj")], gate_up[:intermediate], rtol=0, atol=0)
            torch.testing.assert_close(sent[key("up_proj")], gate_up[intermediate:], rtol=0, atol=0)
            torch.testing.assert_close(sent[key("down_proj")], block.down_proj[expert].detach(), rtol=0, atol=0)
