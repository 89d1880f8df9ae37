"""``qwen3_vl_moe_sparse_experts``: near-misses of transformers 5's experts (``@use_experts_implementation``), which
the probe calls fixed upstream. A dense eager path or another decorator must not pass for it. The replacement itself
is tested in this folder's other tests."""

from __future__ import annotations

import pytest

from tests.source_edits import NearMisses, Variant, check_near_miss, near_miss_cases, prepend_to, replace, substitute

MOE = "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe"
DECORATED = "@use_experts_implementation\nclass Qwen3VLMoeTextExperts"


def dense_path(op: str, code: str) -> Variant:
    """The experts' forward computing ``code`` on every expert's whole parameter first: a dense eager path."""
    edit = prepend_to("Qwen3VLMoeTextExperts", "forward", f"dense = {code}")
    return Variant(f"dense eager path ({op})", MOE, edit)


NEAR_MISSES = [
    NearMisses(
        "qwen3_vl_moe_sparse_experts",
        MOE,
        "tf5-experts-implementation",
        (
            Variant(
                "renamed decorator",
                MOE,
                replace(DECORATED, DECORATED.replace("@use_experts_implementation", "@use_kernel_implementation")),
            ),
            Variant("decorator called", MOE, replace(DECORATED, DECORATED.replace("\n", "()\n"))),
            Variant(
                "decorator of another module",
                MOE,
                substitute(r"from \.\.\.integrations import ", "from ...experts_helpers import "),
            ),
            dense_path("bmm", "torch.bmm(hidden_states, self.gate_up_proj)"),
            dense_path("matmul", "torch.matmul(hidden_states, self.gate_up_proj)"),
            dense_path("@", "hidden_states @ self.gate_up_proj"),
            dense_path("linear on the whole parameter", "F.linear(hidden_states, self.gate_up_proj)"),
            dense_path("einsum", "torch.einsum('th,ehi->eti', hidden_states, self.gate_up_proj)"),
        ),
    ),
]


@pytest.mark.parametrize(("patch", "target", "variant"), near_miss_cases(NEAR_MISSES))
def test_near_miss_of_a_safe_shape_is_not_called_safe(monkeypatch, patch, target, variant):
    check_near_miss(monkeypatch, patch, target, variant)
