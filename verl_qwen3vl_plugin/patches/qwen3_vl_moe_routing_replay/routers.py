"""Replay-aware forwards for the four MoE routers the plugin meets. Each calls upstream's forward
unchanged unless a micro-batch's routes cover it, so replay off is today's numerics bit for bit; under replay it is
upstream's routing (softmax in fp32, top-k, renormalised over the k, cast as upstream casts) with ``routes.top_k``
choosing the experts:

- transformers 4.57's ``Qwen3VLMoeTextSparseMoeBlock`` (its gate is a Linear, the block routes): the dense routing
  matrix its experts read, and the router logits, returned as upstream returns them;
- transformers 5's ``Qwen3VLMoeTextTopKRouter`` and ``Qwen3_5MoeTopKRouter`` (one shape): (logits, top-k weights,
  top-k ids), or (probabilities, ...) where upstream returns those;
- verl's Ascend ``NPUQwen3VLMoeTextSparseMoeBlock``: the routing core it shares with the plugin's routing fix
  (``moe_routing``, ``npu_qwen3_vl_moe_routing``), whose top-k already goes through ``routes.top_k``; in training and
  eval alike, so replay never runs verl 0.7.1's mis-weighted training routing. verl 0.7.0's experts read top-k
  weights in training: they get those.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from verl_qwen3vl_plugin import originals
from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay import routes
from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay.moe_routing import dense_block_forward, dense_routing


def _replay_aware(cls: type, replay: Callable) -> None:
    """``cls.forward`` calls ``replay(self, hidden_states)`` while a micro-batch's routes cover the module,
    upstream's forward otherwise."""
    upstream = cls.forward

    @functools.wraps(upstream)
    def forward(self, hidden_states: torch.Tensor):
        if not routes.replaying(self):
            return upstream(self, hidden_states)
        return replay(self, hidden_states)

    # Around the forward installed now. On Ascend verl 0.7.1 the routing fix may replace it later (the NPU hook runs
    # after the model hook); its forward routes through routes.top_k, so replay still acts there.
    originals.replace(cls, "forward", routes.mark(forward))
    routes.register_router(cls)


def sparse_block_replay(self: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers 4.57's sparse block under replay: (experts' output, router logits)."""
    batch_size = hidden_states.shape[0]
    tokens = hidden_states.reshape(-1, self.hidden_size)
    router_logits, router_weights, router_indices = dense_routing(self, tokens, tokens.dtype)
    out = self.experts(tokens.reshape(batch_size, -1, self.hidden_size), router_weights, router_indices)
    return out, router_logits


def top_k_router_replay(self: nn.Module, hidden_states: torch.Tensor, upstream: Callable) -> tuple[torch.Tensor, ...]:
    """transformers 5's top-k router under replay: upstream's first value (the logits, or the fp32 probabilities
    older releases return), the normalised top-k weights cast to its dtype, the top-k ids. Upstream's forward gives
    the first value, so replay returns what the installed release returns without knowing which it is."""
    first = upstream(self, hidden_states)[0]
    router_logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    top_weights, router_indices = routes.top_k(self, probs, self.top_k)
    return first, (top_weights / top_weights.sum(dim=-1, keepdim=True)).to(first.dtype), router_indices


def patch_sparse_block(module) -> None:
    _replay_aware(module.Qwen3VLMoeTextSparseMoeBlock, sparse_block_replay)


def patch_top_k_router(cls: type) -> None:
    """Qwen3-VL-MoE's or Qwen3.5-MoE's top-k router: the same shape. Once per class: patching it again (each model
    built) changes nothing."""
    if routes.registered(cls):
        return
    _replay_aware(cls, functools.partial(top_k_router_replay, upstream=cls.forward))


def npu_top_k_block_replay(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """verl 0.7.0's Ascend block under replay: its experts read the top-k weights in training, the dense matrix in
    eval, as its own forward hands them."""
    return dense_block_forward(self, hidden_states, top_k_weights=self.training)


def patch_npu_block(module, top_k_in_training: bool) -> None:
    replay = npu_top_k_block_replay if top_k_in_training else dense_block_forward
    _replay_aware(module.NPUQwen3VLMoeTextSparseMoeBlock, replay)
