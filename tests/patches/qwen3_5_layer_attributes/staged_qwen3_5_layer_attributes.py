"""verl's Qwen3.5 layer forwards on the transformers releases past its pin: 5.13 renamed the decoder layer's
``layer_type`` to ``block_type``, and 5.16 moved the gated delta-net's kernels (``causal_conv1d_fn``,
``chunk_gated_delta_rule``, ...) from the layer to module-level functions. A tiny Qwen3.5 and Qwen3.5-MoE, built from
configs, give the same hidden states with verl's decoder-layer and gated delta-net forwards installed (as
``apply_monkey_patch`` installs them) as with transformers' own. Before the fix the first forward raised
AttributeError on transformers >= 5.13 (below 5.13 the test passes either way)."""

import pytest
import torch
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
)
from verl.models.transformers.qwen3_5 import qwen3_5_decoder_layer_forward, qwen3_5_gated_delta_net_forward

VOCAB = 64
# A gated delta-net layer, then a full-attention one, as the real models interleave them; two value heads per key head.
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    layer_types=["linear_attention", "full_attention"],
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
        "partial_rotary_factor": 0.5,
    },
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=16)
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4)


def tiny_text_model(moe: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    if moe:
        text = {k: v for k, v in TEXT.items() if k != "intermediate_size"} | MOE
        model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text, vision_config=VISION))
    else:
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=TEXT, vision_config=VISION))
    return model.model.language_model.eval()


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3_5", "qwen3_5_moe"])
def test_verl_layer_forwards_equal_transformers(monkeypatch, moe):
    text = tiny_text_model(moe)
    decoder_layer, delta_net = text.layers[0], text.layers[0].linear_attn
    input_ids = torch.randint(0, VOCAB, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # no cache, as verl's training forwards run
        expected = text(input_ids=input_ids, use_cache=False).last_hidden_state
        monkeypatch.setattr(type(decoder_layer), "forward", qwen3_5_decoder_layer_forward)
        monkeypatch.setattr(type(delta_net), "forward", qwen3_5_gated_delta_net_forward)
        found = text(input_ids=input_ids, use_cache=False).last_hidden_state
    torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-5)
