"""CPU reference versions of the ``torch_npu`` ops verl's NPU patches call, written from the Ascend op docs.

Why: the Ascend kernels cannot run without an NPU, yet verl's real ``verl.models.transformers.npu_patch`` (the code
the NPU routing patch fixes) imports ``torch_npu`` and calls these ops. ``fake_torch_npu()`` installs them as a
``torch_npu`` module so that real module imports and runs on the CPU. Each op is built from differentiable torch ops,
so autograd gives the gradients the NPU kernels' backward implements.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F


def npu_moe_token_permute(
    tokens: torch.Tensor, indices: torch.Tensor, num_out_tokens: int | None = None, padded_mode: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy each token once per selected expert, grouped by expert id (stable within an expert).

    Returns the permuted tokens and ``sorted_indices``: for each permuted row, its position in ``indices.flatten()``.
    """
    top_k = indices.shape[1] if indices.dim() == 2 else 1
    sorted_indices = torch.argsort(indices.flatten(), stable=True)
    if num_out_tokens is not None:
        sorted_indices = sorted_indices[:num_out_tokens]
    return tokens.index_select(0, sorted_indices // top_k), sorted_indices.to(torch.int32)


def npu_moe_token_unpermute(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None = None,
    padded_mode: bool = False,
    restore_shape: list[int] | None = None,
) -> torch.Tensor:
    """Inverse of the permute: sum each token's expert outputs, each scaled by its ``probs[token, k]``."""
    top_k = probs.shape[1] if probs is not None else 1
    num_tokens = sorted_indices.numel() // top_k
    rows = permuted_tokens
    if probs is not None:
        rows = rows * probs.flatten().index_select(0, sorted_indices.long()).unsqueeze(1).to(rows.dtype)
    out = rows.new_zeros(num_tokens, rows.shape[1])
    return out.index_add(0, sorted_indices.long() // top_k, rows)


def _group_bounds(group_list: torch.Tensor, group_list_type: int) -> list[tuple[int, int]]:
    sizes = (
        group_list.long().tolist()
        if group_list_type == 1
        else torch.diff(group_list.long(), prepend=torch.zeros(1, dtype=torch.long)).tolist()
    )
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def npu_grouped_matmul(
    x: list[torch.Tensor],
    weight: list[torch.Tensor],
    *,
    bias: list[torch.Tensor] | None = None,
    group_list: torch.Tensor,
    split_item: int = 0,
    group_type: int = 0,
    group_list_type: int = 0,
    **_: object,
) -> list[torch.Tensor]:
    """Grouped matmul with one weight per group, for the single-tensor forms verl uses.

    group_type 0 splits ``x`` by rows (M): out rows of group g = x[rows_g] @ weight[g], concatenated.
    group_type 2 splits the reduction axis (K): out[g] = x[:, K_g] @ weight[K_g], stacked (the weight gradient).
    group_list holds per-group sizes (group_list_type 1) or their cumulative sum (group_list_type 0).
    """
    (a,), (b,) = x, weight
    bounds = _group_bounds(group_list, group_list_type)
    if group_type == 0:
        return [torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(bounds)])]
    if group_type == 2:
        return [torch.stack([a[:, s:e] @ b[s:e] for s, e in bounds])]
    raise NotImplementedError(f"group_type {group_type} is not used by verl")


def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """SwiGLU: split ``x`` in two halves along ``dim``; Swish(first half) * second half."""
    a, b = x.chunk(2, dim=dim)
    return F.silu(a) * b


def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last axis, computed in float32; returns (y, rstd) like the NPU op."""
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + epsilon)
    return (x32 * rstd * gamma.float()).to(x.dtype), rstd


def npu_rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half") -> torch.Tensor:
    """Rotary embedding, "half" mode: x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * r1 + torch.cat((-x2, x1), dim=-1) * r2


def _histc(input: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0, **kwargs) -> torch.Tensor:
    """torch.histc that also counts integer tensors, as it does on NPU (CPU histc rejects them)."""
    if not input.dtype.is_floating_point:
        input = input.float()
    return _ORIGINAL_HISTC(input, bins=bins, min=min, max=max, **kwargs)


_ORIGINAL_HISTC = torch.histc
OPS = (npu_moe_token_permute, npu_moe_token_unpermute, npu_grouped_matmul, npu_swiglu, npu_rms_norm, npu_rotary_mul)


@contextlib.contextmanager
def fake_torch_npu() -> Iterator[types.ModuleType]:
    """Make ``import torch_npu`` give these reference ops (and integer ``torch.histc``) inside the block."""
    module = types.ModuleType("torch_npu")
    module.__dict__.update({op.__name__: op for op in OPS})
    previous = sys.modules.get("torch_npu")
    sys.modules["torch_npu"] = module
    torch.histc = _histc
    try:
        yield module
    finally:
        torch.histc = _ORIGINAL_HISTC
        if previous is None:
            sys.modules.pop("torch_npu", None)
        else:
            sys.modules["torch_npu"] = previous
