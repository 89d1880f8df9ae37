"""Vision data parallelism over verl's Ulysses group: each rank runs the vision tower on a share of the images.

Why: under Ulysses sequence parallelism verl slices a VLM's inputs at the language model's entry, after the vision
tower, so every rank of the group holds every image of the micro-batch and runs the tower on all of them: the
tower's forward, backward and activation memory are repeated SP times.
How: the images (and videos) of one tower call are split into contiguous runs balanced by patch count, one run per
rank. Each rank runs the tower once on its run, or on a one-token dummy image when it has none, so every rank makes
the same calls (under FSDP each is a collective). The merged embeddings and the deepstack features (Qwen3-VL's;
Qwen3.5 has none) travel in one all-gather, back into the original order; its backward sums the gradient over the
group and gives each rank the rows it computed. The tower's parameter gradients, once FSDP averages them over the
group, equal verl's.
Fails closed: the split is only right if every rank of the group holds the same images, so the group first agrees on
what it holds (one small all-gather: image count, patch count, a checksum of ``grid_thw``); on a mismatch every rank
raises the same ``RuntimeError`` instead of hanging in a mis-sized gather.
When it applies, and when it can be removed: the patch's spec, beside this module.
"""

from __future__ import annotations

import functools
import logging
import zlib
from collections.abc import Callable
from functools import cache

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)
# Set on a vision class by verl#5230's apply_monkey_patch once it wrapped the forward with its own vision DP.
VERL_VISION_DP_MARK = "_vision_dp_patched"


def assign(patches: list[int], ranks: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` runs of items, one per rank, balanced by patch count.

    An item goes to the rank whose equal share of the total holds the item's middle patch, so the runs follow the
    input order (the gather needs no permutation) and no rank gets more than its share plus one item. Ranks may get
    an empty run (fewer items than ranks, or one large item).
    """
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    total = sum(patches)
    owners, before = [], 0
    for count in patches:
        owners.append(min((2 * before + count) * ranks // (2 * total), ranks - 1) if total else 0)
        before += count
    runs, start = [], 0
    for rank in range(ranks):
        end = start
        while end < len(owners) and owners[end] == rank:
            end += 1
        runs.append((start, end))
        start = end
    return runs


class _GatherRows(torch.autograd.Function):
    """All-gather row blocks of different lengths in rank order; backward: sum over the group, keep own rows."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, rows: list[int], rank: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.rows, ctx.rank, ctx.group = rows, rank, group
        padded = local.new_zeros(max(rows), local.shape[1])
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in rows]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, rows, strict=True)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)  # all_reduce works in place
        dist.all_reduce(grad, group=ctx.group)
        start = sum(ctx.rows[: ctx.rank])
        return grad[start : start + ctx.rows[ctx.rank]], None, None, None


def gather_rows(local: torch.Tensor, rows: list[int], rank: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``local`` block (``rows[r]`` rows on rank r) concatenated in rank order, on every rank."""
    return _GatherRows.apply(local, rows, rank, group)


def ulysses_group() -> tuple[dist.ProcessGroup | None, int, int]:
    """verl's Ulysses group with its size and this rank's place in it; (None, 1, 0) when there is none."""
    from verl.utils.ulysses import get_ulysses_sequence_parallel_group

    group = get_ulysses_sequence_parallel_group()
    if group is None or not dist.is_initialized() or dist.get_world_size(group) < 2:
        return None, 1, 0
    return group, dist.get_world_size(group), dist.get_rank(group)


def split_output(output) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(merged embeddings, deepstack features) from what this transformers' vision forward returns; Qwen3.5's
    tower has no deepstack features (an empty list)."""
    if isinstance(output, tuple):
        return output[0], list(output[1] or [])
    return output.pooler_output, list(getattr(output, "deepstack_features", None) or [])


def _rebuild_output(output, embeds: torch.Tensor, deepstack: list[torch.Tensor]):
    """The vision forward's return type around the gathered tensors.

    transformers 5's output also holds ``last_hidden_state``, the unmerged patches of this rank's share only:
    it is left out (None) rather than returned partial; verl and transformers read the merged embeddings and the
    deepstack features.
    """
    if isinstance(output, tuple):
        return (embeds, deepstack, *output[2:])
    if hasattr(output, "deepstack_features"):
        return type(output)(pooler_output=embeds, deepstack_features=deepstack)
    return type(output)(pooler_output=embeds)


def agree_on_inputs(grid: list[list[int]], group: dist.ProcessGroup, device: torch.device) -> None:
    """Raise the same ``RuntimeError`` on every rank of ``group`` unless all hold the same ``grid`` (its rows)."""
    summary = [len(grid), sum(t * h * w for t, h, w in grid), zlib.crc32(repr(grid).encode())]
    local = torch.tensor(summary, dtype=torch.int64, device=device)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    seen = torch.stack(parts).tolist()
    if any(s != seen[0] for s in seen):
        held = "; ".join(
            f"rank {dist.get_global_rank(group, r)}: {n} images, {p} patches, grid_thw crc32 {c}"
            for r, (n, p, c) in enumerate(seen)
        )
        raise RuntimeError(
            "vision DP: the ranks of one Ulysses group hold different images, so they cannot split them "
            f"({held}); every rank of a Ulysses group must get the same micro-batch"
        )


@cache
def _warn_fallback(reason: str) -> None:
    logger.warning("verl-qwen3vl-plugin: vision DP falls back to the whole tower on every rank: %s", reason)


def vision_dp_forward(upstream: Callable) -> Callable:
    """The vision tower's ``forward`` that splits its images over verl's Ulysses group when it has > 1 rank. Given
    one already (the class patched again, for another model in the process), it returns it as it is: a second split
    would see each rank's share as ranks holding different images."""
    if getattr(upstream, "splits_over_ulysses", False):
        return upstream

    @functools.wraps(upstream)
    def forward(self: nn.Module, hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs):
        group, size, rank = ulysses_group()
        if group is None:
            return upstream(self, hidden_states, grid_thw, **kwargs)
        if kwargs:  # per-image precomputed tables (transformers 5) that a share cannot be cut from
            _warn_fallback(f"the call passes {sorted(kwargs)}, which cannot be split by image")
            return upstream(self, hidden_states, grid_thw, **kwargs)
        grid = grid_thw.tolist()
        agree_on_inputs(grid, group, hidden_states.device)
        patches = [t * h * w for t, h, w in grid]
        runs = assign(patches, size)
        merge = self.spatial_merge_size**2
        start, end = runs[rank]
        first = sum(patches[:start])
        logger.debug(
            "vision DP: rank %d of %d runs images [%d, %d) of %d: %d of %d patches", rank, size, start, end,
            len(patches), sum(patches[start:end]), sum(patches),
        )  # fmt: skip
        if end > start:
            local = upstream(self, hidden_states[first : first + sum(patches[start:end])], grid_thw[start:end])
        else:  # a one-token image, so this rank makes the tower call every other rank makes
            dummy_grid = grid_thw.new_tensor([[1, self.spatial_merge_size, self.spatial_merge_size]])
            local = upstream(self, hidden_states.new_zeros(merge, hidden_states.shape[1]), dummy_grid)
        embeds, deepstack = split_output(local)
        block = torch.cat([embeds, *deepstack], dim=-1)
        if end == start:
            block = block[:0]  # the dummy's row is dropped; its graph stays, so the backward reaches the tower
        rows = [sum(patches[s:e]) // merge for s, e in runs]
        gathered = gather_rows(block, rows, rank, group).split(embeds.shape[-1], dim=-1)
        return _rebuild_output(local, gathered[0], list(gathered[1:]))

    forward.splits_over_ulysses = True
    return forward


def beside_verl_vision_dp(upstream: Callable) -> Callable:
    """``vision_dp_forward``, passing straight through on a class that verl's own vision DP wrapped
    (``VERL_VISION_DP_MARK``): that wrapper already hands each rank its share, which a second split would refuse as
    ranks holding different images. What the plugin installs; verl, wrapping the tower itself, needs only the split."""
    split = vision_dp_forward(upstream)

    @functools.wraps(upstream)
    def forward(self: nn.Module, *args, **kwargs):
        if getattr(type(self), VERL_VISION_DP_MARK, False):
            return upstream(self, *args, **kwargs)
        return split(self, *args, **kwargs)

    return forward
