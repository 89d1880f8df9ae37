"""Device-safe, vectorized bilinear interpolation of the Qwen3-VL / Qwen3.5 vision position embeddings: one
``fast_pos_embed_interpolate(self, grid_thw)`` for every vision class that calls it.

It reads ``grid_thw`` to the host once (the only device-to-host sync), then builds every index and weight on
``grid_thw.device`` with tensor ops. The table is fetched whole through ``self.pos_embed`` with ids on that device, so
FSDP gathers it there and gradients reach the parameter through the module; the result is never moved. The
interpolation grid values come from ``torch.linspace`` on the CPU, exactly as upstream computes them (the CPU kernel
rounds its upper half differently per vector ISA, so no closed form is bit-identical everywhere), cached per device
and grid size (least recently used sizes evicted past 2^20 values), so memory grows with the distinct sizes seen and a
first call on a new size builds only that size. Corner products and sums run in upstream's order and dtype, which
makes the output bit-identical to upstream's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn

__all__ = ["fast_pos_embed_interpolate", "validate_grid_thw"]


class _GridTables(NamedTuple):
    """Per interpolation-grid value: what the corners need, for the grid sizes of one call laid out back to back."""

    floor_x_side: torch.Tensor
    ceil_x_side: torch.Tensor
    floor: torch.Tensor
    ceil: torch.Tensor
    frac: torch.Tensor
    one_minus_frac: torch.Tensor


# Per (device, num_grid_per_side, n): the six tables of the grid linspace(0, side - 1, n), least recently used first.
# Bounded by total length (the sum of the cached n), so memory grows with the distinct sizes seen, and a long run
# through many sizes evicts the least recently used ones instead of growing without limit.
_GRID_CACHE: OrderedDict[tuple[torch.device, int, int], tuple[torch.Tensor, ...]] = OrderedDict()
_GRID_CACHE_MAX_VALUES = 1 << 20  # 24 MiB of int32 / fp32 tables per process at the most
_grid_cache_values = 0
# Rows are gathered, weighted and summed one corner at a time, in steps of about this many elements: small enough for
# a step's rows to stay in the CPU's L2 cache between the four corners' passes, and the only buffer is one step of one
# corner. On the CPU, forward, 16 and 64 images: 2^16 to 2^17 best at hidden 1152, 2^17 to 2^19 alike at hidden 16
# (benchmarks/pos_embed.py --sweep-steps).
_STEP_ELEMENTS = {"cpu": 1 << 17}
_DEFAULT_STEP_ELEMENTS = 1 << 22
# Corner indices and weights (32 bytes a patch, as much again while they are built) are built for this many patches
# at once: few enough calls that their ~20 small ops vanish in the cost, and bounded buffers (2 MiB) on any grid.
_CHUNK_PATCHES = 1 << 15
# Scattering the gradient: index_put_(accumulate=True) beats index_add_ on short rows (2.4x at hidden 16 on the CPU),
# index_add_ wins on long ones (1.6x at hidden 1152).
_INDEX_PUT_BELOW_HIDDEN = 128


def validate_grid_thw(grid_thw: torch.Tensor, grid: list[list[int]], merge_size: int) -> None:
    """Raise a ValueError naming the offending rows; upstream returns wrong shapes or fails deep inside torch."""
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        raise ValueError(
            f"grid_thw must have shape (num_images, 3) holding (t, h, w) rows, got {tuple(grid_thw.shape)}"
        )
    if grid_thw.dtype.is_floating_point or grid_thw.dtype.is_complex or grid_thw.dtype == torch.bool:
        raise ValueError(f"grid_thw must hold integers, got dtype {grid_thw.dtype}")
    too_small = [(i, row) for i, row in enumerate(grid) if min(row) < 1]
    if too_small:
        raise ValueError(f"grid_thw rows need t, h, w >= 1; bad rows (index, [t, h, w]): {too_small}")
    unmergeable = [(i, row) for i, row in enumerate(grid) if row[1] % merge_size or row[2] % merge_size]
    if unmergeable:
        raise ValueError(
            f"grid_thw h and w must be multiples of spatial_merge_size={merge_size}; "
            f"bad rows (index, [t, h, w]): {unmergeable}"
        )


def _grid(side: int, n: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The six tables of one grid size on ``device``: computed once, then served from the LRU cache."""
    global _grid_cache_values
    key = (device, side, n)
    cached = _GRID_CACHE.get(key)
    if cached is not None:
        _GRID_CACHE.move_to_end(key)
        return cached
    # The call upstream makes, on the CPU as upstream does: the exact values upstream interpolates with.
    value = torch.linspace(0, side - 1, n)
    floor = value.int()
    ceil = (floor + 1).clip(max=side - 1)
    frac = value - floor
    cached = tuple(x.to(device) for x in (floor * side, ceil * side, floor, ceil, frac, 1 - frac))
    _GRID_CACHE[key] = cached
    _grid_cache_values += n
    while _grid_cache_values > _GRID_CACHE_MAX_VALUES and len(_GRID_CACHE) > 1:
        (_, _, evicted), _ = _GRID_CACHE.popitem(last=False)
        _grid_cache_values -= evicted
    return cached


def _grid_tables(side: int, sizes: list[int], device: torch.device) -> tuple[_GridTables, dict[int, int]]:
    """The tables of the distinct grid sizes of a call, back to back, and where each size starts in them."""
    starts, start = {}, 0
    for n in sizes:
        starts[n], start = start, start + n
    grids = [_grid(side, n, device) for n in sizes]
    return _GridTables(*(torch.cat(parts) for parts in zip(*grids, strict=True))), starts


def _patch_positions(
    grid_thw: torch.Tensor, grid: list[list[int]], merge: int, starts: dict[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each patch of each item's first frame finds its grid row and column in the grid tables (``starts``:
    where each grid size begins in them): (patches,) int32 each, in the vision tower's merge order (patch p of merge
    block b is row b * m * m + p).

    The arithmetic runs per merge block (a quarter of the patches at m = 2); only the last step crosses each block's
    m rows with its m columns.
    """
    device = grid_thw.device
    num_blocks = sum(h * w for _, h, w in grid) // (merge * merge)
    _, h, w = grid_thw.to(device=device, dtype=torch.int32).unbind(1)
    blocks_per_row = w // merge
    frame_blocks = (h // merge) * blocks_per_row
    item = torch.arange(len(grid), device=device, dtype=torch.int32)
    item = torch.repeat_interleave(item, frame_blocks, output_size=num_blocks)
    first_block = torch.cumsum(frame_blocks, 0, dtype=torch.int32) - frame_blocks
    block = torch.arange(num_blocks, device=device, dtype=torch.int32) - first_block.index_select(0, item)
    per_row = blocks_per_row.index_select(0, item)
    block_row = block // per_row
    block_col = block - block_row * per_row
    # One small copy per call, from pinned memory on CUDA so it does not block: where each item's sizes start.
    item_starts = [[starts[h] for _, h, _ in grid], [starts[w] for _, _, w in grid]]
    pinned = device.type == "cuda"
    row_start, col_start = torch.tensor(item_starts, dtype=torch.int32, pin_memory=pinned).to(device, non_blocking=True)
    # Patch p of a block sits at row p // m, column p % m of it.
    patch = torch.arange(merge * merge, device=device, dtype=torch.int32)
    rows = torch.add(block_row.mul_(merge).add_(row_start.index_select(0, item))[:, None], patch // merge)
    cols = torch.add(block_col.mul_(merge).add_(col_start.index_select(0, item))[:, None], patch % merge)
    return rows.view(-1), cols.view(-1)


def _corners(tables: _GridTables, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Table rows and fp32 weights of the four corners of the given patches, (4, patches) each."""
    row_lo, row_hi = tables.floor_x_side.index_select(0, rows), tables.ceil_x_side.index_select(0, rows)
    dh, one_minus_dh = tables.frac.index_select(0, rows), tables.one_minus_frac.index_select(0, rows)
    col_lo, col_hi = tables.floor.index_select(0, cols), tables.ceil.index_select(0, cols)
    dw, one_minus_dw = tables.frac.index_select(0, cols), tables.one_minus_frac.index_select(0, cols)
    indices = torch.empty(4, rows.numel(), dtype=torch.int32, device=rows.device)
    weights = torch.empty(4, rows.numel(), dtype=torch.float32, device=rows.device)
    # Upstream's corner order and products: (floor, floor), (floor, ceil), (ceil, floor), (ceil, ceil).
    corners = [
        (row_lo, col_lo, one_minus_dh, one_minus_dw),
        (row_lo, col_hi, one_minus_dh, dw),
        (row_hi, col_lo, dh, one_minus_dw),
        (row_hi, col_hi, dh, dw),
    ]
    for c, (row, col, row_weight, col_weight) in enumerate(corners):
        torch.add(row, col, out=indices[c])
        torch.mul(row_weight, col_weight, out=weights[c])
    return indices, weights


def _steps(
    target: torch.Tensor, tables: _GridTables, rows: torch.Tensor, cols: torch.Tensor, step: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Yield (``target``'s rows, corner indices (4, n), corner weights (4, n, 1)) for runs of ``step`` patches, in
    order. Corners are built _CHUNK_PATCHES at a time and the views made in bulk: slicing each step in Python would
    cost about a tenth of the call at hidden 1152."""
    for first in range(0, rows.numel(), _CHUNK_PATCHES):
        indices, weights = _corners(tables, rows[first : first + _CHUNK_PATCHES], cols[first : first + _CHUNK_PATCHES])
        targets = target[first : first + indices.shape[1]].split(step)
        yield from zip(targets, indices.split(step, 1), weights[:, :, None].split(step, 1), strict=True)


def _step_rows(hidden: int, device: torch.device) -> int:
    return max(1, _STEP_ELEMENTS.get(device.type, _DEFAULT_STEP_ELEMENTS) // max(hidden, 1))


class _BilinearGather(torch.autograd.Function):
    """out[r] = sum_c table[corner c of patch r] * weight[c, r] for the first frame of each item; ``frame_rows``
    (when given) then copies first-frame rows to every frame.

    Only the patches' grid positions are kept for backward: corner indices and weights are rebuilt a chunk at a time
    when needed, so neither they nor the gathered rows ever exist for the whole output. Forward rounds the fp32
    weights to the table's dtype, then multiplies and adds in upstream's order and dtype (bit-identical results; a
    fused multiply-add, as in ``addcmul``, would round once instead of twice). Backward scatters ``grad * weight``
    into a float32 table gradient with the fp32 weights, so a bf16 table gets the fp32 gradient rounded once.
    """

    @staticmethod
    def forward(
        ctx,
        table: torch.Tensor,
        rows: torch.Tensor,
        cols: torch.Tensor,
        tables: _GridTables,
        frame_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        num_rows, hidden = rows.numel(), table.shape[1]
        step = _step_rows(hidden, table.device)
        out = table.new_empty(num_rows, hidden)
        corner = table.new_empty(min(step, num_rows), hidden)
        for acc, indices, weights in _steps(out, tables, rows, cols, step):
            index, weight, part = indices.unbind(), weights.to(table.dtype).unbind(), corner[: len(acc)]
            torch.index_select(table, 0, index[0], out=acc).mul_(weight[0])
            for c in (1, 2, 3):  # upstream's order: ((p0 + p1) + p2) + p3
                acc.add_(torch.index_select(table, 0, index[c], out=part).mul_(weight[c]))
        ctx.save_for_backward(rows, cols, frame_rows)
        ctx.tables, ctx.table_shape, ctx.table_dtype = tables, table.shape, table.dtype
        return out if frame_rows is None else out.index_select(0, frame_rows)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        rows, cols, frame_rows = ctx.saved_tensors
        if frame_rows is not None:  # sum each video's frames in fp32 before scattering
            frames = torch.zeros(rows.numel(), grad_out.shape[1], device=grad_out.device)
            grad_out = frames.index_add_(0, frame_rows, grad_out.float())
        hidden = grad_out.shape[1]
        step = _step_rows(hidden, grad_out.device)
        grad = torch.zeros(ctx.table_shape, dtype=torch.float32, device=grad_out.device)
        for g, indices, weights in _steps(grad_out, ctx.tables, rows, cols, step):
            contributions = (g.float() * weights).view(-1, hidden)
            if hidden < _INDEX_PUT_BELOW_HIDDEN:
                grad.index_put_((indices.reshape(-1),), contributions, accumulate=True)
            else:
                grad.index_add_(0, indices.reshape(-1), contributions)
        return grad.to(ctx.table_dtype), None, None, None, None


def _frame_rows(grid_thw: torch.Tensor, grid: list[list[int]]) -> torch.Tensor:
    """For every output row, its row among the items' first frames (upstream repeats each frame t times)."""
    device = grid_thw.device
    t, h, w = grid_thw.to(device=device, dtype=torch.int64).unbind(1)
    frame = h * w
    rows = t * frame
    item = torch.repeat_interleave(
        torch.arange(len(grid), device=device), rows, output_size=sum(r[0] * r[1] * r[2] for r in grid)
    )
    local = torch.arange(item.numel(), device=device) - (torch.cumsum(rows, 0) - rows)[item]
    return (torch.cumsum(frame, 0) - frame)[item] + local % frame[item]


def fast_pos_embed_interpolate(self: nn.Module, grid_thw: torch.Tensor) -> torch.Tensor:
    """Position embeddings for every patch of every image/video in ``grid_thw``, in the vision tower's merge order.

    Args:
        self: a ``Qwen3VLVisionModel`` or ``Qwen3VLMoeVisionModel`` (uses ``pos_embed``, ``num_grid_per_side`` and
            ``config.spatial_merge_size``).
        grid_thw: (num_images, 3) integer tensor of (t, h, w) patch-grid sizes; the result lives on its device.

    Returns:
        (sum(t * h * w), hidden) tensor in the table's dtype.
    """
    merge = self.config.spatial_merge_size
    side = self.num_grid_per_side
    device = grid_thw.device
    grid = grid_thw.tolist() if grid_thw.dim() == 2 else []  # the one device-to-host sync
    validate_grid_thw(grid_thw, grid, merge)
    # The whole table, fetched through the module like upstream's lookup: FSDP (1 or 2, CPU offload or not) gathers
    # and places the weight only inside pos_embed's own forward, so reading `.weight` here would see a shard.
    # ids on grid_thw's device: that is where FSDP2 with CPU offload puts the gathered weight.
    table = self.pos_embed(torch.arange(self.pos_embed.num_embeddings, device=device)).to(device)
    if not grid:
        return table[:0].clone()

    tables, starts = _grid_tables(side, sorted({n for _, h, w in grid for n in (h, w)}), device)
    rows, cols = _patch_positions(grid_thw, grid, merge, starts)
    # Videos: every frame of an item has the same embedding, computed once and copied (as upstream repeats it).
    frame_rows = None if all(t == 1 for t, _, _ in grid) else _frame_rows(grid_thw, grid)
    return _BilinearGather.apply(table, rows, cols, tables, frame_rows)
