"""The MoE routing core of a self-routing sparse block, with its top-k through routing replay's choice
(``routes.top_k``): softmax in fp32, top-k, renormalise, cast, always scattered. Replay's routers run it, and so does
the Ascend routing fix (``patches.npu_qwen3_vl_moe_routing.replacement``), so both route alike."""

from __future__ import annotations

import torch
from torch import nn

from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay import routes


def dense_routing(block: nn.Module, tokens: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """A self-routing sparse block's routing of ``tokens``: (router logits, the dense (tokens, experts) matrix of
    renormalised top-k weights in ``dtype`` (None: the logits'), the top-k ids); the top-k through routing replay's
    choice."""
    router_logits = block.gate(tokens)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    top_weights, router_indices = routes.top_k(block, probs, block.top_k)
    top_weights = (top_weights / top_weights.sum(dim=-1, keepdim=True)).to(dtype or router_logits.dtype)
    return router_logits, torch.zeros_like(router_logits).scatter_(1, router_indices, top_weights), router_indices


def dense_block_forward(block: nn.Module, hidden_states: torch.Tensor, top_k_weights: bool = False) -> torch.Tensor:
    """verl's Ascend block forward on ``dense_routing``'s routes, one for the fix and for replay alike: its experts
    get the dense matrix (both of verl 0.7.1's expert paths read it), or with ``top_k_weights`` the top-k weights
    gathered from it (verl 0.7.0's experts read those in training)."""
    batch_size = hidden_states.shape[0]
    tokens = hidden_states.reshape(-1, block.hidden_size)
    _, dense, router_indices = dense_routing(block, tokens)
    weights = dense.gather(1, router_indices) if top_k_weights else dense
    return block.experts(tokens.reshape(batch_size, -1, block.hidden_size), weights, router_indices)
