"""Gated delta-net (Qwen3.5's linear attention) over samples packed into one row, kept apart at their boundaries, in
plain torch: what runs where flash-linear-attention's varlen kernel does not (no FLA, every Ascend NPU, the CPU).

transformers' torch fallback carries the recurrent state (and its causal convolution the last kernel - 1 tokens)
from one packed sample into the next; verl 0.9 keeps them apart with a Python loop over samples on transformers
<= 5.8 only. Here each sample is cut into chunks of ``chunk_size`` (its last one zero-filled), so everything inside a
chunk is computed once for all chunks of all samples; only the state passed from chunk to chunk is sequential, and
that loop runs over the longest sample's chunk count, the state of every sample still going carried as one batch
(samples sorted by length, so the ones still going are a prefix). Causality makes the zero fill exact: no real token
ever reads a later one. One host sync per call, for the lengths, when the caller has no CPU copy of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # transformers' and FLA's chunk size


class Layout:
    """Where each packed token sits in the chunk grid, and which chunks make up each step of the recurrence.

    Samples are sorted longest first; step ``j`` holds chunk ``j`` of the ``active[j]`` samples that have one, stored
    at grid rows ``starts[j]:starts[j] + active[j]``.
    """

    def __init__(self, lengths: list[int], device: torch.device, chunk_size: int = CHUNK) -> None:
        if not lengths or min(lengths) < 0:
            raise ValueError(f"packed sample lengths must be a non-empty list of non-negative ints, got {lengths}")
        self.total, self.chunk_size = sum(lengths), chunk_size
        chunks = [-(-n // chunk_size) for n in lengths]
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        self.active = [sum(c > j for c in chunks) for j in range(max(chunks, default=0))]
        self.starts = [sum(self.active[:j]) for j in range(len(self.active))]
        self.rows = sum(chunks)
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        # gather[slot] = the packed token at that grid slot, or ``total`` (a zero row) for the fill
        gather = torch.full((self.rows * chunk_size,), self.total, dtype=torch.long)
        scatter = torch.empty(self.total, dtype=torch.long)  # the grid slot of each packed token
        starts = torch.tensor(self.starts + [self.rows], dtype=torch.long)
        for rank, sample in enumerate(order):
            n = lengths[sample]
            if n == 0:
                continue
            within = torch.arange(n)
            slots = (starts[within // chunk_size] + rank) * chunk_size + within % chunk_size
            gather[slots] = within + offsets[sample]
            scatter[offsets[sample] : offsets[sample] + n] = slots
        self.gather, self.scatter = gather.to(device), scatter.to(device)
        self.position = torch.cat([torch.arange(n) for n in lengths]).to(device)  # each token's index in its sample

    def to_grid(self, x: torch.Tensor) -> torch.Tensor:
        """(total, *rest) packed -> (rows, chunk, *rest), the fill zero."""
        padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
        return padded[self.gather].view(self.rows, self.chunk_size, *x.shape[1:])

    def from_grid(self, x: torch.Tensor) -> torch.Tensor:
        """(rows, chunk, *rest) -> (total, *rest) packed."""
        return x.reshape(self.rows * self.chunk_size, *x.shape[2:])[self.scatter]


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


def _solve_unit_lower(lower: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """X with (I + lower) X = rhs, ``lower`` strictly lower triangular (..., C, C). LAPACK / cuBLAS's triangular
    solve where torch has one for the device; elsewhere (Ascend) forward substitution with matmuls only."""
    if lower.device.type in ("cpu", "cuda"):
        eye = torch.eye(lower.shape[-1], dtype=lower.dtype, device=lower.device)
        return torch.linalg.solve_triangular(lower + eye, rhs, upper=False, unitriangular=True)
    return _forward_substitution(lower, rhs)


def _forward_substitution(lower: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    rows = [rhs[..., :1, :]]
    for i in range(1, lower.shape[-1]):
        rows.append(rhs[..., i : i + 1, :] - lower[..., i : i + 1, :i] @ torch.cat(rows, dim=-2))
    return torch.cat(rows, dim=-2)


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
    if use_qk_l2norm_in_kernel:
        query, key = _l2normalize(query.float()), _l2normalize(key.float())
    q, k, v, g, beta = (layout.to_grid(x[0].float()) for x in (query, key, value, g, beta))
    # (rows, chunk, heads, ...) -> (rows, heads, chunk, ...)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    g, beta = g.transpose(1, 2), beta.transpose(1, 2)
    q = q * q.shape[-1] ** -0.5
    decay = g.cumsum(-1)  # log of the decay from the chunk start
    step = decay.unsqueeze(-1) - decay.unsqueeze(-2)  # [i, j]: log decay from token j to token i
    causal = torch.ones(step.shape[-2:], dtype=torch.bool, device=step.device).tril()
    within = torch.where(causal, step, float("-inf")).exp()  # zero above the diagonal, never overflows
    k_beta = k * beta.unsqueeze(-1)
    lower = (k_beta @ k.transpose(-1, -2) * within).tril(-1)
    solved = _solve_unit_lower(lower, torch.cat([v * beta.unsqueeze(-1), k_beta * decay.exp().unsqueeze(-1)], -1))
    new_values, state_reads = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    inner = q @ k.transpose(-1, -2) * within
    q_decayed = q * decay.exp().unsqueeze(-1)
    k_to_end = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    chunk_decay = decay[..., -1].exp()[..., None, None]

    state = q.new_zeros(layout.active[0] if layout.active else 0, q.shape[1], k.shape[-1], v.shape[-1])
    outputs = []
    for start, active in zip(layout.starts, layout.active, strict=True):
        rows = slice(start, start + active)
        state = state[:active]
        fresh = new_values[rows] - state_reads[rows] @ state
        outputs.append(q_decayed[rows] @ state + inner[rows] @ fresh)
        state = state * chunk_decay[rows] + k_to_end[rows].transpose(-1, -2) @ fresh
    out = torch.cat(outputs).transpose(1, 2)  # (rows, chunk, heads, dv)
    return layout.from_grid(out).unsqueeze(0).to(dtype)
