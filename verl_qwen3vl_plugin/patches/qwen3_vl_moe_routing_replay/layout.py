"""A record's rows in the order the decoder sees its tokens, and back: what both verl code paths share.

verl packs a micro-batch's real tokens into one sequence (remove-padding), pads it on the right to a multiple of the
Ulysses size (and, verl 0.9's ``pad_to_length``, to a bucket), and gives rank r of the group the r-th contiguous
chunk; for a VLM it slices after the embedding, by the same rule. The record follows the same steps with verl's own
``slice_input_tensor``; the recorded routes come back through verl's ``gather_outputs_and_unpad``, as log-probs do.
"""

from __future__ import annotations

import torch


def sp_size(owner) -> int:
    """The Ulysses size of verl's actor or engine (both hold the same two attributes)."""
    return owner.ulysses_sequence_parallel_size if owner.use_ulysses_sp else 1


def decoder_rows(rows: torch.Tensor, pad: int, sp: int) -> torch.Tensor:
    """``rows`` (packed tokens, layers, top_k) with ``pad`` rows of no record, then this rank's Ulysses chunk."""
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, *rows.shape[1:])])
    if sp > 1:
        from verl.utils.ulysses import slice_input_tensor

        rows = slice_input_tensor(rows, dim=0, padding=False)
    return rows


def gathered_rows(local: torch.Tensor, pad: int, sp: int) -> torch.Tensor:
    """The Ulysses group's recorded rows in packed order, the ``pad`` rows dropped. Gathered as bytes: every
    backend all-gathers uint8."""
    if sp > 1:
        from verl.utils.ulysses import gather_outputs_and_unpad

        raw = local.contiguous().view(torch.uint8)
        return gather_outputs_and_unpad(raw, gather_dim=0, unpad_dim=0, padding_size=pad).view(local.dtype)
    return local[: local.shape[0] - pad] if pad else local
