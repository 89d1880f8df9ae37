"""Gated delta-net (Qwen3.5's linear attention) over samples packed into one row, kept apart at their boundaries, in
plain torch: what runs where flash-linear-attention's varlen kernel does not (no FLA, every Ascend NPU, the CPU).

transformers' torch fallback carries the recurrent state (and its causal convolution the last kernel - 1 tokens)
from one packed sample into the next; verl 0.9 keeps them apart with a Python loop over samples on transformers
<= 5.8 only. Here each sample is cut into chunks of ``chunk_size`` (its last one zero-filled), so everything inside a
chunk is computed once for all chunks of all samples; only the state passed from chunk to chunk is sequential, and
that loop runs over the longest sample's chunk count, the state of every sample still going carried as one batch
(samples sorted by length, so the ones still going are a prefix). Causality makes the zero fill exact: no real token
ever reads a later one. Host syncs: one, for the lengths, when the caller has no CPU copy of them, and one copy of
the layout's indices to the device per packing (``layout_for`` keeps the last few).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

CHUNK = 64  # transformers' and FLA's chunk size


class Layout:
    """Where each packed token sits in the chunk grid, and which chunks make up each step of the recurrence.

    The grid is (rows, heads, chunk): a row is one chunk of one sample, heads-major so that every matmul reads
    contiguous blocks. Samples are sorted longest first; step ``j`` holds chunk ``j`` of the ``active[j]`` samples
    that have one, stored at rows ``starts[j]:starts[j] + active[j]``.
    """

    def __init__(self, lengths: list[int], device: torch.device, chunk_size: int = CHUNK) -> None:
        if not lengths or min(lengths) < 0:
            raise ValueError(f"packed sample lengths must be a non-empty list of non-negative ints, got {lengths}")
        self.chunk_size = chunk_size
        chunks = [-(-n // chunk_size) for n in lengths]
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        self.active = [sum(c > j for c in chunks) for j in range(max(chunks, default=0))]
        self.starts = [sum(self.active[:j]) for j in range(len(self.active))]
        self.rows = sum(chunks)
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        self.offsets = offsets  # where each sample starts in the packed row, then where the row ends
        row = torch.empty(offsets[-1], dtype=torch.long)  # each packed token's grid row
        starts = torch.tensor(self.starts + [self.rows], dtype=torch.long)
        for rank, sample in enumerate(order):
            within = torch.arange(lengths[sample])
            row[offsets[sample] : offsets[sample + 1]] = starts[within // chunk_size] + rank
        position = torch.cat([torch.arange(n) for n in lengths])  # each token's index in its sample
        self.row, self.position = torch.stack([row, position]).to(device)  # one copy to the device
        self.slot = self.position % chunk_size  # its place in its chunk

    def to_grid(self, x: torch.Tensor) -> torch.Tensor:
        """(total, heads, *rest) packed -> (rows, heads, chunk, *rest), the fill zero."""
        grid = x.new_zeros(self.rows, x.shape[1], self.chunk_size, *x.shape[2:])
        grid[self.row, :, self.slot] = x
        return grid

    def from_grid(self, x: torch.Tensor) -> torch.Tensor:
        """(rows, heads, chunk, *rest) -> (total, heads, *rest) packed."""
        return x[self.row, :, self.slot]


@functools.lru_cache(maxsize=8)
def layout_for(lengths: tuple[int, ...], device: torch.device) -> Layout:
    """The layout of one packing, built once: every layer of a forward, and its recomputation, packs the same way,
    so the copy of its indices to the device happens once per micro-batch, not once per layer."""
    return Layout(list(lengths), device)


def lengths_of(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None = None) -> list[int]:
    """Sample lengths from cumulative boundaries (the host copy if there is one: no device sync)."""
    bounds = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
    if bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:], strict=False)):
        raise ValueError(f"cu_seqlens must start at 0 and never decrease, got {bounds}")
    return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layout: Layout) -> torch.Tensor:
    """SiLU of the depthwise causal convolution of ``x`` (1, channels, total), restarted at each sample: a tap that
    would reach into the previous sample reads zero, as it reads the zero padding of a sample run alone.

    ``weight`` is (channels, kernel) or conv1d's (channels, 1, kernel).
    """
    weight = weight.reshape(weight.shape[0], -1)
    kernel = weight.shape[-1]
    padded = F.pad(x, (kernel - 1, 0))
    out = x * weight[:, -1:]
    for back in range(1, kernel):  # the tap ``back`` tokens behind
        reachable = (layout.position >= back).to(x.dtype)
        out = (
            out
            + padded[..., kernel - 1 - back : kernel - 1 - back + x.shape[-1]] * weight[:, -1 - back, None] * reachable
        )
    if bias is not None:
        out = out + bias[:, None]
    return F.silu(out)


def _unit_lower_inverse(lower: torch.Tensor) -> torch.Tensor:
    """(I + lower)^-1 for ``lower`` strictly lower triangular (..., n, n): the inverse of a block lower triangular
    matrix from its diagonal blocks' inverses, [[A, 0], [C, D]]^-1 = [[A^-1, 0], [-D^-1 C A^-1, D^-1]].
    Batched matmuls only, so the same code on every device (Ascend has no batched triangular solve in torch); on the
    CPU faster than LAPACK's batched solve for 64 x 64 chunks."""
    n = lower.shape[-1]
    if n == 1:
        return torch.ones_like(lower)
    half = n // 2
    top = _unit_lower_inverse(lower[..., :half, :half])
    bottom = _unit_lower_inverse(lower[..., half:, half:])
    corner = -(bottom @ lower[..., half:, :half]) @ top
    zeros = lower.new_zeros(*lower.shape[:-2], half, n - half)
    return torch.cat([torch.cat([top, zeros], -1), torch.cat([corner, bottom], -1)], -2)


def _decay_within(decay: torch.Tensor) -> torch.Tensor:
    """[..., i, j]: the decay from token j to token i of a chunk (``decay``: cumulative log decays), zero above the
    diagonal; the exponent is masked before ``exp``, so it never overflows."""
    step = decay.unsqueeze(-1) - decay.unsqueeze(-2)
    causal = torch.ones(step.shape[-2:], dtype=torch.bool, device=step.device).tril()
    return torch.where(causal, step, float("-inf")).exp()


def _l2normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)  # FLA's and transformers' epsilon


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    layout: Layout,
    use_qk_l2norm_in_kernel: bool = True,
) -> torch.Tensor:
    """The chunked gated delta rule of packed samples (``query``/``key`` (1, total, heads, dk), ``value`` (1, total,
    heads, dv), ``g``/``beta`` (1, total, heads)), each sample from a zero state: (1, total, heads, dv) in
    ``query``'s dtype. Training only: no initial or final state (verl's packed forward carries none)."""
    dtype = query.dtype
    scale = query.shape[-1] ** -0.5
    if use_qk_l2norm_in_kernel:
        query, key = _l2normalize(query.float()), _l2normalize(key.float())
    # (rows, heads, chunk, ...): every sample's chunks at once. Each temporary is dropped as soon as it is used,
    # which in eval (verl's log-prob passes) lowers the peak; in training autograd keeps what backward needs.
    q, k, v, g, beta = (layout.to_grid(x[0].float()) for x in (query, key, value, g, beta))
    decay = g.cumsum(-1)  # log of the decay from the chunk start
    within = _decay_within(decay)
    k_beta = k * beta.unsqueeze(-1)
    # The delta rule inside a chunk: (I + tril(K_beta K^T * within, -1)) solves for what each token writes.
    solve = _unit_lower_inverse((k_beta @ k.transpose(-1, -2) * within).tril(-1))
    new_values = solve @ (v * beta.unsqueeze(-1))
    state_reads = solve @ (k_beta * decay.exp().unsqueeze(-1))
    del solve, k_beta, v
    inner = q @ k.transpose(-1, -2) * (within * scale)
    del within
    q_decayed = q * (decay.exp() * scale).unsqueeze(-1)
    k_to_end = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    chunk_decay = decay[..., -1].exp()[..., None, None]
    del q, k

    out = new_values.new_empty(new_values.shape)  # (rows, heads, chunk, dv)
    state = out.new_zeros(layout.active[0] if layout.active else 0, out.shape[1], k_to_end.shape[-1], out.shape[-1])
    for start, active in zip(layout.starts, layout.active, strict=True):
        rows = slice(start, start + active)
        state = state[:active]
        fresh = new_values[rows] - state_reads[rows] @ state
        out[rows] = q_decayed[rows] @ state + inner[rows] @ fresh
        state = state * chunk_decay[rows] + k_to_end[rows].transpose(-1, -2) @ fresh
    return layout.from_grid(out).unsqueeze(0).to(dtype)
