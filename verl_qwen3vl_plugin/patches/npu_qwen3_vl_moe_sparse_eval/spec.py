"""Target of ``npu_qwen3_vl_moe_sparse_eval``: ``verl.models.transformers.npu_patch`` (imported by verl on Ascend
only), whose ``NPUQwen3VLMoeTextExperts.forward`` is wrapped; the wrapper also calls the module's ``NPUGmmFunction``.

Both shapes have ``forward(self, hidden_states, routing_weights, router_indices)``. Their grouped path calls
``npu_moe_token_permute``, ``NPUGmmFunction.apply`` on ``self.gate_up_proj`` and then ``self.down_proj`` with
``npu_swiglu`` between them, and ``npu_moe_token_unpermute``, and makes no dense product (``repeat``, ``bmm``,
``matmul``, ``einsum``). The wrapper's eval runs exactly that path, so the probe checks each of those calls.

- ``DENSE_EVAL``: one branch on ``training``, ``if self.training:``, holding the grouped path; its ``else`` repeats
  every token for every expert (``repeat``) and multiplies with ``bmm``.
- ``GROUPED_IN_EVERY_MODE``: no branch on ``training``, and the forward itself is the grouped path.
"""

from __future__ import annotations

import ast
from types import ModuleType

from verl_qwen3vl_plugin import originals, syntax
from verl_qwen3vl_plugin.registry import NPU, Decision, Patch, Shape, Target, Verdict, unrecognized
from verl_qwen3vl_plugin.upstream import NPU_PATCH

EXPERTS = "NPUQwen3VLMoeTextExperts"
GMM = "NPUGmmFunction"


SIGNATURE = ["self", "hidden_states", "routing_weights", "router_indices"]
DENSE_OPS = ("repeat", "bmm", "matmul", "einsum")


GROUPED_IN_EVERY_MODE = Shape(
    id="grouped-in-every-mode", verdict=Verdict.FIXED_UPSTREAM, elsewhere="no release yet: the fix this patch proposes"
)
DENSE_EVAL = Shape(id="dense-eval", verdict=Verdict.APPLY)


def _gmm_operands(node: ast.AST) -> list[str]:
    """The weight operand of each ``NPUGmmFunction.apply(x, weight, counts)`` in ``node``, as source text."""
    return [
        ast.unparse(c.args[1])
        for c in syntax.call_nodes(node, "apply")
        if isinstance(c.func, ast.Attribute) and ast.unparse(c.func.value) == GMM and len(c.args) == 3
    ]


def _grouped(node: ast.AST) -> bool:
    """verl's grouped path: permute, gate_up GEMM, swiglu, down GEMM, unpermute."""
    return (
        all(syntax.calls(node, op) for op in ("npu_moe_token_permute", "npu_swiglu", "npu_moe_token_unpermute"))
        and _gmm_operands(node) == ["self.gate_up_proj", "self.down_proj"]
        and not any(syntax.calls(node, op) for op in DENSE_OPS)
    )


def probe(tree: ast.Module) -> Decision:
    forward = syntax.find_function(syntax.find_class(tree, EXPERTS), "forward")
    if forward is None or syntax.find_class(tree, GMM) is None:
        return unrecognized(f"no {EXPERTS}.forward or {GMM} in verl's npu_patch")
    if syntax.parameters(forward) != SIGNATURE:
        return unrecognized(f"{EXPERTS}.forward is not ({', '.join(SIGNATURE)})")
    branches = [n for n in ast.walk(forward) if isinstance(n, ast.If) and syntax.mentions(n.test, "training")]
    if not branches and _grouped(forward):
        return GROUPED_IN_EVERY_MODE.decision(f"{EXPERTS}.forward is grouped in every mode")
    if len(branches) == 1 and ast.unparse(branches[0].test) == "self.training":
        training, other = ast.Module(branches[0].body, []), ast.Module(branches[0].orelse, [])
        if _grouped(training) and syntax.calls(other, "bmm") and syntax.calls(other, "repeat"):
            return DENSE_EVAL.decision(f"{EXPERTS}.forward runs every expert on every token when not training")
    return unrecognized(f"{EXPERTS}.forward matches no known verl release's grouped/dense split")


def _apply(module: ModuleType, decision: Decision) -> None:
    from verl_qwen3vl_plugin.patches.npu_qwen3_vl_moe_sparse_eval.replacement import grouped_eval_forward

    gmm = getattr(module, GMM)
    originals.wrap(getattr(module, EXPERTS), "forward", lambda verl_forward: grouped_eval_forward(verl_forward, gmm))


DETAILS = """\
**Details of the change.** Eval takes the top-k weights from the dense routing matrix that the block scatters in eval
on every verl, so it works on verl 0.7.0 too, whose training path takes the top-k weights directly. Eval then runs
the same ops as training. `tests/patches/npu_qwen3_vl_moe_sparse_eval/test_numerics.py`, on the CPU reference
`torch_npu` ops, finds the eval output bit-identical to training's and within 1e-5 of verl's dense eval. Measured times
of the reference ops (not of Ascend): `docs/performance.md`.

**Upstream plan.** verl#6131 touched this block's routing and left the dense eval. The change to propose is the
`else` branch of `NPUQwen3VLMoeTextExperts.forward` in `verl/models/transformers/npu_patch.py`, as
`[model, hardware] perf: grouped eval path for NPU Qwen3-VL-MoE experts`, with the CPU reference-op test in a
`*_on_cpu.py` file beside verl's model tests.
"""

PATCH = Patch(
    name="npu_qwen3_vl_moe_sparse_eval",
    title="grouped eval for verl's Ascend Qwen3-VL-MoE experts",
    group=NPU,
    targets=(Target(module=NPU_PATCH, probe=probe, apply=_apply, shapes=(DENSE_EVAL, GROUPED_IN_EVERY_MODE)),),
    devices=("npu",),
    why=(
        "verl's Ascend Qwen3-VL-MoE experts run every expert on every token in eval, which is how verl computes old "
        "and reference log-probs: E / top_k times the expert FLOPs and E copies of the tokens per layer."
    ),
    how=(
        "verl_qwen3vl_plugin.patches.npu_qwen3_vl_moe_sparse_eval.replacement.grouped_eval_forward:"
        " in eval, the experts' own grouped path "
        "(token permute, verl's grouped matmul, unpermute with the top-k weights); training is verl's forward."
    ),
    upstream=("verl#6131",),
    remove_when="verl's NPUQwen3VLMoeTextExperts.forward is grouped in eval.",
    details=DETAILS,
)
