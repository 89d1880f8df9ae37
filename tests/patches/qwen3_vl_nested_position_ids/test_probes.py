"""``qwen3_vl_nested_position_ids``: near-misses of its safe shapes. verl 0.7.0, whose callers never fix 3-D
position ids (``not_used``): a renamed caller class, or a caller that names the function, must not pass for it.
verl >= 0.8, whose micro-batch splits keep the ragged index (``fixed_upstream`` for the FSDP engine's split): a split
that drops it, or rebuilds as verl 0.7 does, must not pass for it. The fix itself is tested in
``test_in_effect.py``."""

from __future__ import annotations

import pytest

from tests.source_edits import APPLY, NearMisses, Variant, append, check_near_miss, near_miss_cases, substitute

PATCH = "qwen3_vl_nested_position_ids"
ENGINE, UTILS = "verl.workers.engine.fsdp.transformer_impl", "verl.utils.tensordict_utils"
KEPT_INDEX = r"ragged_idx=getattr\(nt, \"_ragged_idx\", nt\.dim\(\) - 1\)"
CHUNK_REBUILD = r"chunk_td\[key\] = nested_tensor_from_tensor_list\("
NEAR_MISSES = [
    NearMisses(
        PATCH,
        ENGINE,
        "verl0.8-splits-keep-ragged-index",
        (
            Variant("the chunk keeps no ragged index", UTILS, substitute(KEPT_INDEX, "layout=None")),
            Variant(
                "the chunk rebuilds with as_nested_tensor",
                UTILS,
                substitute(CHUNK_REBUILD, "chunk_td[key] = torch.nested.as_nested_tensor("),
                APPLY,
            ),
            Variant("the engine splits another way", ENGINE, substitute(r"\bprepare_micro_batches\b", "split_batches")),
        ),
    ),
    NearMisses(
        PATCH,
        ENGINE,
        "verl0.7.0-no-3d-position-fix",
        (
            Variant("a fix of another shape", UTILS, append("def maybe_fix_3d_position_ids(data):\n    pass\n")),
            Variant("the split is renamed", UTILS, substitute(r"\bdef chunk_tensordict\b", "def chunk_batches")),
        ),
    ),
    *(
        NearMisses(
            PATCH,
            target,
            "verl0.7.0-no-3d-position-fix",
            (
                Variant("the class is renamed", target, substitute(rf"(?m)^class {cls}\b", f"class {cls}2")),
                Variant(
                    "the caller names the function",
                    target,
                    append("def _fix(data):\n    maybe_fix_3d_position_ids(data)\n"),
                ),
            ),
        )
        for target, cls in (
            ("verl.workers.engine_workers", "TrainingWorker"),
            ("verl.workers.engine.base", "BaseEngine"),
        )
    ),
]


@pytest.mark.parametrize(("patch", "target", "variant"), near_miss_cases(NEAR_MISSES))
def test_near_miss_of_a_safe_shape_is_not_called_safe(monkeypatch, patch, target, variant):
    check_near_miss(monkeypatch, patch, target, variant)
