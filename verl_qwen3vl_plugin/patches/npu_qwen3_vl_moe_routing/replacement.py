"""Routing for verl's Ascend NPU Qwen3-VL-MoE sparse block that is correct in training and in eval.

Why: verl 0.7.1's ``NPUQwen3VLMoeTextSparseMoeBlock.forward`` scatters the normalised top-k routing weights into the
dense (tokens, num_experts) matrix only when ``not self.training``, while the experts' training path reads
``routing_weights[token, router_indices]`` from that dense matrix. In training the experts are weighted by the
top-k columns misread as expert ids: reward stays flat and ppo_kl is orders of magnitude too low on Ascend (on the
CPU it is an IndexError when num_experts > top_k, or silently wrong numbers when they are equal).
How: the same routing (softmax in fp32, top-k, renormalise, cast to the logits' dtype), always scattered: the routing
core in ``moe_routing``, which routing replay shares. The top-k goes through routing replay's choice, which is
``torch.topk`` unless replay is on for the block.
When it applies, and when it can be removed: the ``npu_qwen3_vl_moe_routing`` spec.
"""

from __future__ import annotations

import torch
from torch import nn

from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay import moe_routing, routes


@routes.mark
def sparse_moe_block_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``NPUQwen3VLMoeTextSparseMoeBlock.forward`` with the dense routing matrix built in every mode: both expert
    paths read it (eval multiplies it in, training gathers [token, router_indices])."""
    return moe_routing.dense_block_forward(self, hidden_states)
