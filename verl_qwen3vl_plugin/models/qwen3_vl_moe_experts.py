"""Sparse Qwen3-VL-MoE experts for transformers 4.57.x: one grouped forward for training and for eval.

Why: transformers 4.57's ``Qwen3VLMoeTextExperts.forward`` runs every expert on every token when not training
(``hidden_states.repeat(num_experts, 1)`` and a ``bmm`` over all experts): E / top_k times the expert FLOPs, and E
copies of the tokens, in every log-prob pass verl makes in eval mode. In training it loops over the experts in
Python, with a host sync per expert and, through tensor indexing of the packed parameters, a zero gradient the size of
the whole parameter per expert. The two modes run different kernels, so recomputed "old" log-probs differ from the
training forward's even on-policy.

How: the (token, expert) pairs are sorted by expert (a stable sort), gathered once, and each projection is one
grouped GEMM over the contiguous per-expert row blocks: ``torch._grouped_mm`` where the device, dtype and strides
allow it, otherwise a loop over experts on contiguous slices after one host sync for the block sizes. Rows are
weighted, put back in (token, k) order by a gather and summed over k: no atomics, so a given input gives the same
bits in either mode. Parameters keep their layout ((E, H, 2I) and (E, I, H)); gradients reach both projections, the
routing weights and the input.

When it applies, and when it can be removed: the ``qwen3_vl_moe_sparse_experts`` spec.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["grouped_experts", "sparse_experts_forward"]


def _grouped_mm_supported(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs these operands: CPU, or CUDA bf16 on a Hopper-class device (SM 9.0+)."""
    if not hasattr(torch, "_grouped_mm") or rows.dtype != weight.dtype:
        return False
    if rows.device.type == "cpu":
        return rows.dtype in (torch.float32, torch.bfloat16)
    if rows.device.type == "cuda":
        return rows.dtype == torch.bfloat16 and torch.cuda.get_device_capability(rows.device)[0] >= 9
    return False


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (grouped GEMM's backward rejects expanded ones)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def grouped_experts(
    rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, use_grouped_mm: bool | None = None
) -> torch.Tensor:
    """``rows`` (sorted by expert, ``counts[e]`` rows each) times ``weight[e]`` for each expert's block of rows.

    ``use_grouped_mm=False`` forces the fallback loop (one host sync for ``counts``); None picks by support.
    """
    if use_grouped_mm is None:
        use_grouped_mm = _grouped_mm_supported(rows, weight)
    if use_grouped_mm:
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        return _ContiguousGrad.apply(torch._grouped_mm(rows.contiguous(), weight.contiguous(), offs=offsets))
    blocks = rows.split(counts.tolist())  # the one host sync of the fallback
    return torch.cat([block @ w for block, w in zip(blocks, weight.unbind(0), strict=True)])


def sparse_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    routing_weights: torch.Tensor,
    router_indices: torch.Tensor,
    use_grouped_mm: bool | None = None,
) -> torch.Tensor:
    """``Qwen3VLMoeTextExperts.forward`` (transformers 4.57): the same arguments and result, in every mode.

    ``routing_weights`` is the dense (tokens, num_experts) matrix the block scatters; ``router_indices`` the top-k.
    """
    batch_size = hidden_states.shape[0]
    tokens = hidden_states.reshape(-1, self.hidden_size)
    top_k = router_indices.shape[-1]
    experts = router_indices.reshape(-1)
    order = torch.argsort(experts, stable=True)  # pair p = token * top_k + k, grouped by expert
    counts = torch.bincount(experts, minlength=self.num_experts)
    rows = tokens.index_select(0, order // top_k)
    gate, up = grouped_experts(rows, self.gate_up_proj, counts, use_grouped_mm).chunk(2, dim=-1)
    out = grouped_experts(up * self.act_fn(gate), self.down_proj, counts, use_grouped_mm)
    weights = routing_weights.gather(1, router_indices.reshape(-1, top_k)).reshape(-1)
    out = out * weights.index_select(0, order).unsqueeze(-1).to(out.dtype)
    # Back to (token, k) order with a gather (no scatter-add), then a fixed-order sum over the k experts.
    pairs = out.index_select(0, torch.argsort(order)).view(-1, top_k, self.hidden_size)
    return pairs.sum(dim=1).to(hidden_states.dtype).view(batch_size, -1, self.hidden_size)
