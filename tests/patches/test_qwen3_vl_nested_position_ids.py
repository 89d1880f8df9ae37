"""``qwen3_vl_nested_position_ids``: near-misses of verl 0.7.0, whose callers never fix 3-D position ids (the probe
says ``not_used``). A renamed caller class, or a caller that names the function, must not pass for it. The fix itself
is tested in ``tests/replacements/test_qwen3_vl_nested_position_ids.py``."""

from __future__ import annotations

import pytest

from tests.source_edits import Shape, Variant, append, check_near_miss, near_miss_cases, substitute

NEAR_MISSES = [
    Shape(
        "qwen3_vl_nested_position_ids",
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
    for target, cls in (("verl.workers.engine_workers", "TrainingWorker"), ("verl.workers.engine.base", "BaseEngine"))
]


@pytest.mark.parametrize(("patch", "target", "variant"), near_miss_cases(NEAR_MISSES))
def test_near_miss_of_a_safe_shape_is_not_called_safe(monkeypatch, patch, target, variant):
    check_near_miss(monkeypatch, patch, target, variant)
