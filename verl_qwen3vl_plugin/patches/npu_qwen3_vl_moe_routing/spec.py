"""Target of ``npu_qwen3_vl_moe_routing``: ``verl.models.transformers.npu_patch``, whose
``NPUQwen3VLMoeTextSparseMoeBlock.forward`` is replaced. verl imports the module only on Ascend, but the probe reads
its source, so the verdict is the same, and tested, on any machine.

Every shape has the block's ``forward(self, hidden_states)`` and the experts' ``forward(self, hidden_states,
routing_weights, router_indices)``, which the replacement calls.

- ``EVAL_ONLY_SCATTER``: the block scatters the top-k weights into the dense matrix (``scatter_``) only under
  ``if not self.training``, and the experts read ``routing_weights[batch_idx, router_indices]`` from that matrix and
  pass no ``probs=routing_weights`` to ``npu_moe_token_unpermute``.
- ``TOP_K_EXPERTS``: the same eval-only scatter, and the experts pass the top-k weights straight to
  ``npu_moe_token_unpermute(..., probs=routing_weights)``, with no two-index read of the dense matrix.
- ``ALWAYS_SCATTERS``: a statement of the block's forward body itself (in no branch, with no conditional expression
  and no mention of ``training``) calls ``scatter_``, and no ``if not self.training`` branch scatters.
"""

from __future__ import annotations

import ast
from types import ModuleType

from verl_qwen3vl_plugin import originals, syntax
from verl_qwen3vl_plugin.registry import NPU, Decision, Patch, Shape, Target, Verdict, unrecognized
from verl_qwen3vl_plugin.upstream import NPU_PATCH

BLOCK = "NPUQwen3VLMoeTextSparseMoeBlock"
EXPERTS = "NPUQwen3VLMoeTextExperts"
EXPERTS_SIGNATURE = ["self", "hidden_states", "routing_weights", "router_indices"]


ALWAYS_SCATTERS = Shape(id="verl0.8-scatters", verdict=Verdict.FIXED_UPSTREAM, verl=">=0.8")
EVAL_ONLY_SCATTER = Shape(id="verl0.7.1-eval-only-scatter", verdict=Verdict.APPLY, verl="==0.7.1")
TOP_K_EXPERTS = Shape(id="verl0.7.0-top-k-experts", verdict=Verdict.FIXED_UPSTREAM, verl="==0.7.0")


def _eval_only_scatter(forward: ast.FunctionDef) -> bool:
    return any(
        isinstance(n, ast.If) and syntax.is_not_training(n.test) and syntax.calls(n, "scatter_")
        for n in ast.walk(forward)
    )


def _always_scatters(forward: ast.FunctionDef) -> bool:
    """A statement of the forward body itself (not nested in a branch) scatters, under no conditional expression and
    without a reference to the mode."""
    return any(
        not isinstance(stmt, ast.If)
        and syntax.calls(stmt, "scatter_")
        and not any(isinstance(n, ast.IfExp) for n in ast.walk(stmt))
        and not syntax.mentions(stmt, "training")
        for stmt in forward.body
    )


def _reads_dense_by_token(experts_forward: ast.FunctionDef) -> bool:
    """``routing_weights[batch_idx, router_indices]``: a 2-D gather from the dense (tokens, experts) matrix."""
    return any(
        isinstance(n, ast.Subscript)
        and isinstance(n.value, ast.Name)
        and n.value.id == "routing_weights"
        and isinstance(n.slice, ast.Tuple)
        and len(n.slice.elts) == 2
        for n in ast.walk(experts_forward)
    )


def _unpermutes_with_top_k(experts_forward: ast.FunctionDef) -> bool:
    """``npu_moe_token_unpermute(..., probs=routing_weights)``: the top-k weights as they came in."""
    return any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "npu_moe_token_unpermute"
        and any(
            k.arg == "probs" and isinstance(k.value, ast.Name) and k.value.id == "routing_weights" for k in n.keywords
        )
        for n in ast.walk(experts_forward)
    )


def probe(tree: ast.Module) -> Decision:
    block = syntax.find_function(syntax.find_class(tree, BLOCK), "forward")
    experts = syntax.find_function(syntax.find_class(tree, EXPERTS), "forward")
    if block is None or experts is None:
        return unrecognized(f"no {BLOCK}.forward or {EXPERTS}.forward in verl's npu_patch")
    if syntax.parameters(block) != ["self", "hidden_states"] or syntax.parameters(experts) != EXPERTS_SIGNATURE:
        return unrecognized(f"{BLOCK}.forward or {EXPERTS}.forward has an unknown signature")
    if _always_scatters(block) and not _eval_only_scatter(block):
        return ALWAYS_SCATTERS.decision(f"{BLOCK}.forward scatters routing weights in every mode")
    if _eval_only_scatter(block) and not _always_scatters(block):
        reads, unpermutes = _reads_dense_by_token(experts), _unpermutes_with_top_k(experts)
        if reads and not unpermutes:
            return EVAL_ONLY_SCATTER.decision(f"{BLOCK}.forward scatters routing weights only in eval; fixed to always")
        if unpermutes and not reads:
            return TOP_K_EXPERTS.decision(f"{EXPERTS} takes the top-k weights directly in training")
    return unrecognized(f"{BLOCK} and {EXPERTS} match no known verl release's routing")


def _apply(module: ModuleType, decision: Decision) -> None:
    from verl_qwen3vl_plugin.patches.npu_qwen3_vl_moe_routing.replacement import sparse_moe_block_forward

    originals.replace(getattr(module, BLOCK), "forward", sparse_moe_block_forward)


DETAILS = """\
**Seen.** Nothing errors on the NPU: training Qwen3-VL-MoE (e.g. Qwen3-VL-30B-A3B) runs, with wrong expert weights.
On verl 0.7.1 with transformers <= 4.57.3, verl's `apply_monkey_patch` also replaces this block's `forward` (its
"4.57.3 bug" workaround), which happens to hide the mismatch. transformers 4.57.4 to 4.57.6, the vllm-ascend 0.13
stack, expose it.

**Tests.** `tests/patches/npu_qwen3_vl_moe_routing/test_numerics.py` runs verl's real `npu_patch` on the CPU, over
reference `torch_npu` ops written from the Ascend op documentation (`verl_qwen3vl_plugin/selftest/npu_reference.py`).
Against transformers' block with the same weights, outputs and input and weight gradients agree within 1e-5 in training
and eval, and so do a whole tiny Qwen3-VL-MoE's loss and gradients. Without the plugin the same test shows verl's bug.

**Upstream plan.** verl#6131 removed the `if not self.training` guard, released in verl 0.8.0. What remains worth
proposing is the test, which lets verl's CPU CI check the NPU block against transformers in training and eval:
`[model, test] test: cover NPU Qwen3-VL-MoE sparse block against transformers in train and eval`, the reference ops
as a test helper and the test in a `*_on_cpu.py` file beside verl's model tests. For a 0.7.x backport branch the fix
itself would be `[model] fix: scatter NPU Qwen3-VL-MoE routing weights in training`, in
`NPUQwen3VLMoeTextSparseMoeBlock.forward` (`verl/models/transformers/npu_patch.py`), with the same test.
"""

PATCH = Patch(
    name="npu_qwen3_vl_moe_routing",
    title="routing weights in training, Ascend Qwen3-VL-MoE",
    group=NPU,
    targets=(
        Target(
            module=NPU_PATCH,
            probe=probe,
            apply=_apply,
            shapes=(EVAL_ONLY_SCATTER, TOP_K_EXPERTS, ALWAYS_SCATTERS),
        ),
    ),
    devices=("npu",),
    why=(
        "verl 0.7.1's Ascend Qwen3-VL-MoE block builds its dense routing matrix only in eval, while its experts "
        "read it in training too: reward stays flat and ppo_kl is orders of magnitude below the GPU run."
    ),
    how=(
        "verl_qwen3vl_plugin.patches.npu_qwen3_vl_moe_routing.replacement.sparse_moe_block_forward"
        " replaces the block's forward: "
        "the same routing, scattered in every mode."
    ),
    upstream=("verl#6131",),
    remove_when="verl 0.7.1 is no longer run on Ascend.",
    details=DETAILS,
)
