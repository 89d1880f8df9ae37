"""Device-safe, vectorized bilinear interpolation of the Qwen3-VL vision position embeddings.

Why: transformers' ``Qwen3VLVisionModel.fast_pos_embed_interpolate`` (4.57.x to 5.8.x; the MoE vision model holds a
copy) builds its index and weight tensors on ``self.pos_embed.weight.device``. Under FSDP2 with CPU offload that is
the CPU while the patches live on the accelerator, and the vision forward fails with a device mismatch. verl PR #6131
(and #6332, which moved the function out of the Qwen3.5 module) fixed the device, but kept a per-image Python loop,
a ``.tolist()`` per patch and two blocking host-to-device copies per call.

How: one function serves ``Qwen3VLVisionModel`` and ``Qwen3VLMoeVisionModel``. It reads ``grid_thw`` to the host once
(the only device-to-host sync), then builds every index and weight on ``grid_thw.device`` with tensor ops, moving the
table there (never the result) so gradients still reach the parameter. The interpolation grid values come from
``torch.linspace`` on the CPU, exactly as upstream computes them (the CPU kernel rounds its upper half differently
per vector ISA, so no closed form is bit-identical everywhere), cached per device so a steady state copies nothing.
Corner products and sums run in upstream's order and dtype, which makes the output bit-identical to upstream's.

Remove when: the oldest supported transformers computes on ``grid_thw``'s device (5.9 does) and verl >= 0.8 is the
floor (its ``apply_monkey_patch`` installs its own device fix).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["fast_pos_embed_interpolate", "validate_grid_thw"]

# Per (device, num_grid_per_side): floor, ceil and fractional part of linspace(0, side - 1, n) for n = 1..len, laid
# out back to back (row n starts at n * (n - 1) / 2).
_GRID_CACHE: dict[tuple[torch.device, int], tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
# Rows are gathered and summed in blocks of about this many elements: on the CPU the four corner products then stay
# in cache instead of streaming four (rows, hidden) temporaries through memory; on an accelerator blocks are large.
_BLOCK_ELEMENTS = {"cpu": 1 << 15}
_DEFAULT_BLOCK_ELEMENTS = 1 << 24


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


def _grid_values(side: int, max_n: int, device: torch.device):
    """Return (len, floor, ceil, frac) tables covering sizes 1..len >= max_n on ``device``."""
    key = (device, side)
    cached = _GRID_CACHE.get(key)
    if cached is None or cached[0] < max_n:
        n_max = max(64, 1 << (max_n - 1).bit_length())
        # The same call upstream makes, so the values are the ones upstream interpolates with on this machine.
        value = torch.cat([torch.linspace(0, side - 1, n) for n in range(1, n_max + 1)])
        floor = value.int()
        ceil = (floor + 1).clip(max=side - 1)
        frac = value - floor
        cached = (n_max, *(x.to(device) for x in (floor, ceil, frac)))
        _GRID_CACHE[key] = cached
    return cached


def _blocks(num_rows: int, hidden: int, device: torch.device) -> range:
    step = max(1, _BLOCK_ELEMENTS.get(device.type, _DEFAULT_BLOCK_ELEMENTS) // max(hidden, 1))
    return range(0, num_rows, step)


class _BilinearGather(torch.autograd.Function):
    """out[r] = sum_c table[indices[c, r]] * weights[c, r], without keeping the gathered rows alive for backward.

    ``weights`` are float32. Forward rounds them to the table's dtype and multiplies and adds in upstream's order
    (bit-identical results). Backward scatters ``grad * weight`` into the table in float32 with the fp32 weights, so
    a bf16 table gets the fp32 gradient rounded once.
    """

    @staticmethod
    def forward(ctx, table: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        num_rows, hidden = indices.shape[1], table.shape[1]
        out = table.new_empty(num_rows, hidden)
        blocks = _blocks(num_rows, hidden, table.device)
        corner = table.new_empty(min(blocks.step, num_rows), hidden)
        for start in blocks:
            stop = min(start + blocks.step, num_rows)
            # Upstream rounds the fp32 weights to the table's dtype before multiplying.
            w = weights[:, start:stop, None].to(table.dtype)
            out_block = out[start:stop]
            torch.index_select(table, 0, indices[0, start:stop], out=out_block).mul_(w[0])
            for c in range(1, 4):
                tmp = torch.index_select(table, 0, indices[c, start:stop], out=corner[: stop - start])
                out_block.add_(tmp.mul_(w[c]))
        ctx.save_for_backward(indices, weights)
        ctx.table_shape = table.shape
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        indices, weights = ctx.saved_tensors
        grad = torch.zeros(ctx.table_shape, dtype=torch.float32, device=grad_out.device)
        num_rows, hidden = grad_out.shape
        blocks = _blocks(num_rows, hidden, grad_out.device)
        for start in blocks:
            stop = min(start + blocks.step, num_rows)
            g = grad_out[start:stop].float()
            for c in range(4):
                grad.index_add_(0, indices[c, start:stop], g * weights[c, start:stop, None])
        return grad.to(grad_out.dtype), None, None


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
    table = self.pos_embed.weight.to(device)  # differentiable: gradients flow back to an offloaded table
    if not grid:
        return table[:0].clone()

    num_rows = sum(t * h * w for t, h, w in grid)
    max_n = max(max(h, w) for _, h, w in grid)
    _, floor, ceil, frac = _grid_values(side, max_n, device)

    g = grid_thw.to(device=device, dtype=torch.long)
    t, h, w = g.unbind(1)
    frame = h * w
    rows_per_item = t * frame
    item = torch.repeat_interleave(torch.arange(len(grid), device=device), rows_per_item, output_size=num_rows)
    first_row = torch.cumsum(rows_per_item, 0) - rows_per_item
    # Position inside one frame, in merge order: (block row, block col, row in block, col in block).
    q = (torch.arange(num_rows, device=device) - first_row[item]) % frame[item]
    in_block = q % (merge * merge)
    block = q // (merge * merge)
    blocks_per_row = (w // merge)[item]
    row = (block // blocks_per_row) * merge + in_block // merge
    col = (block % blocks_per_row) * merge + in_block % merge
    # Row n of the cached tables starts at n * (n - 1) / 2.
    hi = (h * (h - 1) // 2)[item] + row
    wi = (w * (w - 1) // 2)[item] + col

    h_floor, h_ceil, dh = floor[hi], ceil[hi], frac[hi]
    w_floor, w_ceil, dw = floor[wi], ceil[wi], frac[wi]
    indices = torch.stack(
        [h_floor * side + w_floor, h_floor * side + w_ceil, h_ceil * side + w_floor, h_ceil * side + w_ceil]
    )
    weights = torch.stack([(1 - dh) * (1 - dw), (1 - dh) * dw, dh * (1 - dw), dh * dw])
    return _BilinearGather.apply(table, indices, weights)
