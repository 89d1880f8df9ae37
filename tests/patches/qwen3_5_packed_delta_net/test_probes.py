"""``qwen3_5_packed_delta_net``: near-misses of the shapes its probes call ``not_used``: verl 0.8 without a delta-net
forward of its own, and verl replacing the layer's forward (its own module is then the target that acts). A verl
forward of another shape must not pass for them; where verl's forward is gone, transformers' layer runs and the
plugin wraps it. The wrapper itself is tested in ``test_numerics.py``."""

from __future__ import annotations

import pytest

from tests.source_edits import APPLY, NearMisses, Variant, append, check_near_miss, near_miss_cases, substitute

PATCH = "qwen3_5_packed_delta_net"
QWEN3_5_VERL = "verl.models.transformers.qwen3_5"
LAYERS = ("transformers.models.qwen3_5.modeling_qwen3_5", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
VERL_FORWARD = r"\bqwen3_5_gated_delta_net_forward\b"
NEAR_MISSES = [
    NearMisses(
        PATCH,
        QWEN3_5_VERL,
        "verl0.8-no-delta-net-forward",
        (
            Variant(
                "verl defines a delta-net forward of another shape",
                QWEN3_5_VERL,
                append("def qwen3_5_gated_delta_net_forward(self, hidden_states):\n    return 0\n"),
            ),
            Variant(
                "the base forward is renamed",
                QWEN3_5_VERL,
                substitute(r"\bdef qwen3_5_base_forward\b", "def qwen3_5_base_forward2"),
            ),
        ),
    ),
    *(
        NearMisses(
            PATCH,
            target,
            "verl-replaces-layer-forward",
            (
                # Without verl's forward, or with apply_monkey_patch no longer installing it, transformers' layer
                # runs: the plugin wraps it, which is right whether verl's decoder passes boundaries or not.
                Variant(
                    "verl's forward is renamed", QWEN3_5_VERL, substitute(VERL_FORWARD, "qwen3_5_linear_forward"), APPLY
                ),
                Variant(
                    "apply_monkey_patch no longer installs it",
                    "verl.models.transformers.monkey_patch",
                    substitute(VERL_FORWARD, "qwen3_5_linear_forward"),
                    APPLY,
                ),
            ),
        )
        for target in LAYERS
    ),
]


@pytest.mark.parametrize(("patch", "target", "variant"), near_miss_cases(NEAR_MISSES))
def test_near_miss_of_a_safe_shape_is_not_called_safe(monkeypatch, patch, target, variant):
    check_near_miss(monkeypatch, patch, target, variant)
