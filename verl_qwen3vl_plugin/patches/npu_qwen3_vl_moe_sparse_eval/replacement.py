"""verl's Ascend Qwen3-VL-MoE experts with their grouped path in eval too.

When it applies, and when it can be removed: the ``npu_qwen3_vl_moe_sparse_eval`` spec.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn


def grouped_eval_forward(experts_forward: Callable, gmm: type[torch.autograd.Function]) -> Callable:
    """``NPUQwen3VLMoeTextExperts.forward`` (``experts_forward``) whose eval runs the experts' own grouped path, not a
    dense ``bmm``.

    The dense eval branch repeats every token for every expert (E / top_k times the FLOPs, E copies of the tokens) in
    each log-prob pass. Here eval permutes the tokens by expert, runs the grouped matmul ``gmm`` (``NPUGmmFunction``)
    on each projection and unpermutes with the top-k weights, as training does; so eval and training give the same
    bits. Training is ``experts_forward`` itself.

    ``routing_weights``: the dense (tokens, experts) matrix the block scatters in eval on every verl.
    """

    @functools.wraps(experts_forward)
    def forward(
        self: nn.Module, hidden_states: torch.Tensor, routing_weights: torch.Tensor, router_indices: torch.Tensor
    ) -> torch.Tensor:
        if self.training:
            return experts_forward(self, hidden_states, routing_weights, router_indices)
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

    return forward
