"""Self-test of ``qwen3_vl_nested_position_ids``: per-sample ``(4, seq)`` rope ids packed as TransferQueue packs
them, through verl's ``maybe_fix_3d_position_ids`` and the plugin's, read as verl's FSDP engine reads them."""

from __future__ import annotations

import torch

from verl_qwen3vl_plugin.patches.qwen3_vl_nested_position_ids.replacement import MAX_ROPE_ROWS as ROPE_ROWS
from verl_qwen3vl_plugin.selftest import Check


def samples(lengths: list[int]) -> list[torch.Tensor]:
    """Per-sample ``(4, seq)`` rope ids, distinct per sample and row."""
    return [torch.arange(ROPE_ROWS * n).view(ROPE_ROWS, n) + 1000 * i for i, n in enumerate(lengths)]


def packed_batch(lengths: list[int]):
    """A TensorDict batch holding the samples' ids packed as TransferQueue packs a field."""
    from tensordict import TensorDict

    ids = torch.nested.as_nested_tensor(samples(lengths), layout=torch.jagged)
    return TensorDict({"position_ids": ids}, batch_size=[len(lengths)])


def engine_rows(fix, lengths: list[int]) -> tuple[torch.Tensor | None, str]:
    """What verl's ``prepare_model_inputs`` packs after ``fix``: ``values()`` as (rope rows, total tokens), or the
    error the per-sample split raises."""
    batch = packed_batch(lengths)
    fix(batch)
    try:
        batch["position_ids"].unbind()  # verl's per-sample split
    except RuntimeError as exc:
        return None, f"{type(exc).__name__}: {str(exc)[:80]}"
    return batch["position_ids"].values(), ""


def run() -> list[Check]:
    from verl.utils import tensordict_utils

    from verl_qwen3vl_plugin.patches.qwen3_vl_nested_position_ids.replacement import maybe_fix_3d_position_ids
    from verl_qwen3vl_plugin.patches.qwen3_vl_nested_position_ids.spec import FUNCTION

    upstream = getattr(tensordict_utils, FUNCTION, None)  # verl's own (verl 0.7.0 has none)
    checks = []
    for lengths in ([5, 5, 5], [5, 7, 3]):
        expected = torch.cat(samples(lengths), dim=-1)
        rows, error = engine_rows(maybe_fix_3d_position_ids, lengths)
        ok = rows is not None and torch.equal(rows, expected)
        detail = f"engine rows {tuple(rows.shape) if rows is not None else error}, expected {tuple(expected.shape)}"
        if upstream is not None:
            before, before_error = engine_rows(upstream, lengths)
            detail += f"; verl's: {tuple(before.shape) if before is not None else before_error}"
        checks.append(Check(f"3-d position_ids of lengths {lengths}", ok, detail))
    return checks
