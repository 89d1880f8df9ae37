"""``vision_placeholder_ban``: near-misses of the shapes its probe calls safe: verl 0.9 banning the processor's
placeholder ids itself (``banned_token_ids``), and a verl that patches vLLM's logits in another module than the
target. Neither may pass for a module that bans or patches some other way. The ban itself is tested in
``test_in_effect.py``."""

from __future__ import annotations

import pytest

from tests.source_edits import NearMisses, Variant, append, check_near_miss, near_miss_cases, substitute

PATCH = "vision_placeholder_ban"
UTILS, ROLLOUT = "verl.workers.rollout.vllm_rollout.utils", "verl.workers.rollout.vllm_rollout.vllm_rollout"
NEAR_MISSES = [
    NearMisses(
        PATCH,
        UTILS,
        "verl0.9-banned-token-ids",
        (Variant("the ban parameter is renamed", UTILS, substitute(r"\bbanned_token_ids\b", "banned_ids")),),
    ),
    *(
        NearMisses(
            PATCH,
            target,
            "logits-patched-in-other-module",
            (
                Variant(
                    "the module patches compute_logits another way",
                    target,
                    append("def _patch(model):\n    model.compute_logits = None\n"),
                ),
                # What tells verl's module from another of its name.
                Variant("not verl's module", target, substitute(rf"\b{marker}\b", f"{marker}2")),
            ),
        )
        for target, marker in ((UTILS, "get_vllm_max_lora_rank"), (ROLLOUT, "ServerAdapter"))
    ),
]


@pytest.mark.parametrize(("patch", "target", "variant"), near_miss_cases(NEAR_MISSES))
def test_near_miss_of_a_safe_shape_is_not_called_safe(monkeypatch, patch, target, variant):
    check_near_miss(monkeypatch, patch, target, variant)
