"""Routing for verl's Ascend NPU Qwen3-VL-MoE sparse block that is correct in training and in eval.

Why: verl 0.7.1's ``NPUQwen3VLMoeTextSparseMoeBlock.forward`` scatters the normalised top-k routing weights into the
dense (tokens, num_experts) matrix only when ``not self.training``, while the experts' training path reads
``routing_weights[token, router_indices]`` from that dense matrix. In training the experts are weighted by the
top-k columns misread as expert ids: reward stays flat and ppo_kl is orders of magnitude too low on Ascend (on the
CPU it is an IndexError when num_experts > top_k, or silently wrong numbers when they are equal).
How: the same routing (softmax in fp32, top-k, renormalise, cast to the logits' dtype), always scattered.
When it applies, and when it can be removed: the ``npu_qwen3_vl_moe_routing`` spec (``patches/npu_qwen3_vl_moe.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn


def sparse_moe_block_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``NPUQwen3VLMoeTextSparseMoeBlock.forward`` with the dense routing matrix built in every mode."""
    batch_size = hidden_states.shape[0]
    tokens = hidden_states.reshape(-1, self.hidden_size)
    router_logits = self.gate(tokens)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    top_weights, router_indices = torch.topk(probs, self.top_k, dim=-1)
    top_weights = (top_weights / top_weights.sum(dim=-1, keepdim=True)).to(router_logits.dtype)
    # Both expert paths read this dense matrix: eval multiplies it in, training gathers [token, router_indices].
    routing_weights = torch.zeros_like(router_logits).scatter_(1, router_indices, top_weights)
    return self.experts(tokens.reshape(batch_size, -1, self.hidden_size), routing_weights, router_indices)


def experts_to_transformers5_layout(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Weight-sync pairs with verl's NPU experts as transformers 5 lays them out, for splits written for that layout.

    verl's NPU block keeps transformers 4.57's packing: ``gate_up_proj`` (E, H, 2I) and ``down_proj`` (E, I, H).
    transformers 5 stores their per-expert transposes, (E, 2I, H) and (E, H, I). Views only: nothing is copied here.
    """
    for name, tensor in weights:
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) and tensor.dim() == 3:
            tensor = tensor.transpose(1, 2)
        yield name, tensor


def grouped_eval_forward(verl_forward: Callable, gmm: type[torch.autograd.Function]) -> Callable:
    """``NPUQwen3VLMoeTextExperts.forward`` whose eval runs the experts' own grouped path, not a dense ``bmm``.

    verl's eval branch repeats every token for every expert (E / top_k times the FLOPs, E copies of the tokens) in
    each log-prob pass. Here eval permutes the tokens by expert, runs verl's grouped matmul (``gmm``, verl's
    ``NPUGmmFunction``) on each projection and unpermutes with the top-k weights, as training does; so eval and
    training give the same bits. Training is verl's own forward. ``routing_weights`` is the dense (tokens, experts)
    matrix the block scatters in eval on every verl.
    """

    def forward(
        self: nn.Module, hidden_states: torch.Tensor, routing_weights: torch.Tensor, router_indices: torch.Tensor
    ) -> torch.Tensor:
        if self.training:
            return verl_forward(self, hidden_states, routing_weights, router_indices)
        import torch_npu

        batch_size = hidden_states.shape[0]
        tokens = hidden_states.reshape(-1, self.hidden_size)
        permuted, row_ids_map = torch_npu.npu_moe_token_permute(tokens, router_indices.to(torch.int32))
        tokens_per_expert = torch.histc(router_indices, bins=self.num_experts, min=0, max=self.num_experts)
        hidden = torch_npu.npu_swiglu(gmm.apply(permuted, self.gate_up_proj, tokens_per_expert), dim=-1)
        out = gmm.apply(hidden, self.down_proj, tokens_per_expert)
        top_k_weights = routing_weights.gather(1, router_indices)
        return torch_npu.npu_moe_token_unpermute(out, row_ids_map, probs=top_k_weights).view(
            batch_size, -1, self.hidden_size
        )

    forward.__wrapped__ = verl_forward
    return forward
