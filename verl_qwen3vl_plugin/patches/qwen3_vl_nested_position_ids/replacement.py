"""Multimodal ``position_ids`` laid out as verl's FSDP engine reads them: a jagged nested tensor whose ragged
dimension is the sequence (``[n, rope rows, j]``, values ``(rope rows, total tokens)``, offsets per sequence).

Two other layouts reach verl's ``maybe_fix_3d_position_ids``, which only sets ``_ragged_idx = 2``:
- rope-packed: TransferQueue (verl 0.9's data path) packs each sample's ``(4, seq)`` ids with
  ``torch.nested.as_nested_tensor(..., layout=torch.jagged)``, and torch makes the dimension that varies ragged:
  the sequence when lengths differ, the 4 rope rows when every sample has the same length (values ``(n * 4, seq)``,
  offsets ``0, 4, 8, ...``). GRPO's n responses to one prompt, each cut at the same maximum, have equal lengths.
  Setting the index on it makes an inconsistent tensor: ``split_with_sizes`` errors, or a rotary shape mismatch;
- sequence-packed with its index reset to 1 (a TensorDict pickle round trip): values and offsets are right, and
  setting the index is the whole fix, as verl intends.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tensordict import TensorDict

KEY = "position_ids"
# verl's multimodal position ids have one text row and up to three rotary rows: a layout with more leading rows than
# this holds several samples' rows (rope-packed).
MAX_ROPE_ROWS = 4


def sequence_ragged(position_ids: torch.Tensor) -> torch.Tensor:
    """``position_ids`` with the sequence as its ragged dimension: the same tensor where its values and offsets
    already are sequence-packed (its index set to 2 in place, as verl does), a rebuilt one where they are rope-packed;
    unchanged where it is not a 3-d jagged nested tensor. A layout neither of these raises a ValueError naming it."""
    if not (position_ids.is_nested and position_ids.dim() == 3 and position_ids.layout is torch.jagged):
        return position_ids
    values, offsets = position_ids.values(), position_ids.offsets()
    rows, total = offsets.diff(), int(offsets[-1])
    if values.shape[-1] == total and values.shape[0] <= MAX_ROPE_ROWS:  # sequence-packed
        position_ids._ragged_idx = 2
        return position_ids
    if rows.numel() and values.shape[0] == total and int(rows[0]) <= MAX_ROPE_ROWS and bool((rows == rows[0]).all()):
        batch, rope, seq = rows.numel(), int(rows[0]), values.shape[-1]  # rope-packed: every sample one length
        values = values.reshape(batch, rope, seq).transpose(0, 1).reshape(rope, batch * seq)
        offsets = torch.arange(batch + 1, device=offsets.device, dtype=offsets.dtype) * seq
        return torch.nested.nested_tensor_from_jagged(values, offsets=offsets, jagged_dim=2)
    raise ValueError(
        f"{KEY}: a 3-d nested tensor in no known layout (values {tuple(values.shape)}, offsets {offsets.tolist()})"
    )


def maybe_fix_3d_position_ids(data: TensorDict) -> None:
    """verl's ``maybe_fix_3d_position_ids(data)``: the batch's 3-d nested ``position_ids`` made sequence-ragged,
    whichever of the known layouts it arrived in. A rebuilt tensor is written back even into a locked TensorDict (a
    consolidated batch is locked), as verl's in-place index change reaches one."""
    if KEY not in data.keys() or not (data[KEY].is_nested and data[KEY].dim() == 3):
        return
    fixed = sequence_ragged(data[KEY])
    if fixed is data[KEY]:
        return
    locked = data.is_locked
    if locked:
        data.unlock_()
    try:
        data[KEY] = fixed
    finally:
        if locked:
            data.lock_()


def canonical_micro_batches(upstream: Callable) -> Callable:
    """verl's ``prepare_micro_batches(data, ...) -> (micro_batches, indices)`` with each micro-batch's 3-d nested
    ``position_ids`` made sequence-ragged (``maybe_fix_3d_position_ids``) after the split."""

    @functools.wraps(upstream)
    def prepare_micro_batches(data: TensorDict, *args, **kwargs):
        micro_batches, indices = upstream(data, *args, **kwargs)
        for micro_batch in micro_batches:
            maybe_fix_3d_position_ids(micro_batch)
        return micro_batches, indices

    return prepare_micro_batches
