"""Qwen3-VL-MoE's experts (``Qwen3VLMoeTextExperts``) run only the experts each token is routed to, in training and in
eval alike, so the model gives the same log-probabilities in both modes. Before, eval ran every expert on every token
(a dense ``bmm`` over all experts, num_experts / top_k times the expert FLOPs) and training looped over the experts:
reinforcement-learning trainers, which recompute log-probabilities in eval mode, saw them differ from the training
forward's for the same input.

An expert no token is routed to gets NaN weights here: computing it at all turns every output NaN, so a finite result
shows it was skipped. The log-probabilities are compared in float32, where the two old paths differ on the CPU (in
bfloat16 they round to the same values at this size).
"""

import pytest
import torch
from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeTextConfig
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextExperts

NUM_EXPERTS, TOP_K, HIDDEN = 8, 2, 32
TEXT = {
    "vocab_size": 128, "hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "num_experts": NUM_EXPERTS,
    "num_experts_per_tok": TOP_K, "moe_intermediate_size": 24, "decoder_sparse_step": 1,
    "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
}  # fmt: skip
VISION = {
    "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": HIDDEN,
    "num_position_embeddings": 64, "deepstack_visual_indexes": [0], "patch_size": 4, "temporal_patch_size": 2,
    "spatial_merge_size": 2,
}  # fmt: skip


def randomized(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return module


def test_eval_and_training_give_the_same_log_probs():
    config = Qwen3VLMoeConfig(
        text_config=TEXT, vision_config=VISION, image_token_id=100, video_token_id=101, vision_start_token_id=102
    )
    model = randomized(Qwen3VLMoeForConditionalGeneration(config))
    input_ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(1))
    log_probs = {}
    for mode in ("eval", "train"):
        getattr(model, mode)()
        log_probs[mode] = torch.log_softmax(model(input_ids=input_ids).logits, dim=-1)
    torch.testing.assert_close(log_probs["eval"], log_probs["train"], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_eval_runs_only_the_routed_experts(dtype):
    experts = randomized(Qwen3VLMoeTextExperts(Qwen3VLMoeTextConfig(**TEXT))).to(dtype)
    generator = torch.Generator().manual_seed(2)
    tokens = 20
    hidden_states = torch.randn(1, tokens, HIDDEN, generator=generator).to(dtype)
    # Top-k of the first NUM_EXPERTS - 1 experts: the last one is routed no token.
    scores = torch.rand(tokens, NUM_EXPERTS - 1, generator=generator)
    top, router_indices = scores.topk(TOP_K, dim=-1)
    routing_weights = torch.zeros(tokens, NUM_EXPERTS).scatter_(1, router_indices, top / top.sum(-1, keepdim=True))
    routing_weights = routing_weights.to(dtype)
    with torch.no_grad():
        experts.gate_up_proj[-1] = float("nan")
        experts.down_proj[-1] = float("nan")
    outputs = {}
    for mode in ("eval", "train"):
        getattr(experts, mode)()
        outputs[mode] = experts(hidden_states, routing_weights, router_indices)
    assert torch.isfinite(outputs["eval"]).all(), "eval computed the expert no token is routed to"
    torch.testing.assert_close(outputs["eval"], outputs["train"], rtol=0, atol=0)
    # Each token's output is its routed experts' SwiGLU outputs, weighted.
    expected = torch.zeros(tokens, HIDDEN)
    for token in range(tokens):
        for k in range(TOP_K):
            expert = router_indices[token, k]
            gate, up = (hidden_states[0, token].float() @ experts.gate_up_proj[expert].float()).chunk(2)
            out = (torch.nn.functional.silu(gate) * up) @ experts.down_proj[expert].float()
            expected[token] += routing_weights[token, expert].float() * out
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(outputs["eval"][0].float(), expected, **tolerance)
