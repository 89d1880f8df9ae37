"""Sparse Qwen3-VL-MoE experts for transformers 4.57.x: one grouped forward for training and for eval.

Why: transformers 4.57's ``Qwen3VLMoeTextExperts.forward`` runs every expert on every token when not training
(``hidden_states.repeat(num_experts, 1)`` and a ``bmm`` over all experts): E / top_k times the expert FLOPs, and E
copies of the tokens, in every log-prob pass verl makes in eval mode. In training it loops over the experts in
Python, with a host sync per expert and, through tensor indexing of the packed parameters, a zero gradient the size of
the whole parameter per expert. The two modes run different kernels, so recomputed "old" log-probs differ from the
training forward's even on-policy.

How: the (token, expert) pairs are sorted by expert (a stable sort), gathered once, and each projection is one
grouped GEMM over the contiguous per-expert row blocks: ``torch._grouped_mm`` where it is known to be right
(``grouped_mm_is_right``), otherwise a loop over experts on contiguous slices after one host sync for the block
sizes. Rows are weighted, put back in (token, k) order by a gather and summed over k: no atomics, so a given input
gives the same bits in either mode. Parameters keep their layout ((E, H, 2I) and (E, I, H)); gradients reach both
projections, the routing weights and the input; an expert with no tokens gets exactly zero.

When it applies, and when it can be removed: the ``qwen3_vl_moe_sparse_experts`` spec.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

__all__ = ["grouped_experts", "grouped_mm_is_right", "sparse_experts_forward"]
logger = logging.getLogger("verl_qwen3vl_plugin")


def grouped_mm_is_right(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` is known to be right here: CUDA bf16 on compute capability 9.x (on 10.x its
    backward gives experts with no tokens a non-zero gradient, pytorch#172439), or the CPU where it runs right."""
    if device.type == "cuda":
        return (
            dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] == 9 and _runs_right(device, dtype)
        )
    if device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16) and _runs_right(device, dtype)
    return False


@functools.cache
def _runs_right(device: torch.device, dtype: torch.dtype) -> bool:
    """Tried once per device and dtype, not read off the symbol (torch >= 2.6 is allowed, the CPU kernel is newer):
    a product of three groups, the middle one empty, must match a loop, and its weight must get exactly zero
    gradient."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        with torch.inference_mode(False), torch.enable_grad():
            generator = torch.Generator().manual_seed(0)
            rows = torch.randn(5, 16, generator=generator).to(device, dtype).requires_grad_()
            weight = torch.randn(3, 16, 8, generator=generator).to(device, dtype).requires_grad_()
            offsets = torch.tensor([2, 2, 5], dtype=torch.int32, device=device)
            out = torch._grouped_mm(rows, weight, offs=offsets)
            out.float().square().sum().backward()
        loop = torch.cat([rows[:2] @ weight[0], rows[2:] @ weight[2]])
        return bool(torch.allclose(out.float(), loop.float(), rtol=2e-2, atol=2e-2) and (weight.grad[1] == 0).all())
    except Exception as exc:  # the kernel rejects this device, dtype or build: the loop it is
        logger.info("verl-qwen3vl-plugin: torch._grouped_mm not used on %s %s (%s)", device, dtype, exc)
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
        use_grouped_mm = rows.dtype == weight.dtype and grouped_mm_is_right(rows.device, rows.dtype)
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
