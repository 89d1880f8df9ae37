"""Target of ``qwen3_vl_moe_sparse_experts``: transformers' Qwen3-VL-MoE modeling module, whose
``Qwen3VLMoeTextExperts.forward`` is replaced. Where verl's Ascend ``npu_patch`` replaces the whole sparse MoE block,
the patched experts never run: the patch is applied but dormant there (``replaced_on_npu``).

- ``DENSE_EVAL``: the class has no decorator, its ``__init__`` builds ``gate_up_proj`` as ``LAYOUT``, the packing the
  replacement multiplies with, and ``forward(self, hidden_states, routing_weights, router_indices)`` calls ``repeat``
  and ``bmm``: a dense eval branch over all experts.
- ``EXPERTS_IMPLEMENTATION``: the class is decorated with a bare ``@use_experts_implementation``, imported from
  transformers' ``integrations`` by a relative import, and its own ``forward``, the eager path, computes no dense
  product over all experts: no ``repeat``, ``bmm``, ``matmul`` or ``einsum``, and no ``linear`` or ``@`` on a whole
  packed parameter.
"""

from __future__ import annotations

import ast
from types import ModuleType

from verl_qwen3vl_plugin import environment, originals, syntax
from verl_qwen3vl_plugin.families import QWEN3_VL_MOE
from verl_qwen3vl_plugin.registry import MODEL, Decision, Patch, Shape, Target, Verdict, unrecognized
from verl_qwen3vl_plugin.upstream import NPU_PATCH

EXPERTS = "Qwen3VLMoeTextExperts"
SIGNATURE = ["self", "hidden_states", "routing_weights", "router_indices"]


DENSE_OPS = ("repeat", "bmm", "matmul", "einsum")
# The affected experts' packing, which the replacement multiplies with: (E, H, 2I).
LAYOUT = ["self.num_experts", "self.hidden_size", "2 * self.expert_dim"]


EXPERTS_IMPLEMENTATION = Shape(id="tf5-experts-implementation", verdict=Verdict.FIXED_UPSTREAM, transformers=">=5")
DENSE_EVAL = Shape(id="dense-eval", verdict=Verdict.APPLY, transformers="<5")


def _dense_products(forward: ast.FunctionDef) -> list[str]:
    """The ops in ``forward`` that compute over every expert at once: a dense op, or ``linear`` / ``@`` on a whole
    packed parameter (transformers 5's eager loop indexes one expert's slice: ``self.gate_up_proj[expert_idx]``)."""
    found = [op for op in DENSE_OPS if syntax.calls(forward, op)]
    whole = ("self.gate_up_proj", "self.down_proj")
    for n in ast.walk(forward):
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.MatMult) and ast.unparse(n.right) in whole:
            found.append("@")
        elif isinstance(n, ast.Call) and ast.unparse(n.func).split(".")[-1] == "linear" and len(n.args) > 1:
            found += ["linear"] * (ast.unparse(n.args[1]) in whole)
    return found


def _imports_decorator(tree: ast.Module) -> bool:
    """``use_experts_implementation`` imported from transformers' ``integrations`` (relative import)."""
    return any(
        isinstance(n, ast.ImportFrom)
        and n.level > 0
        and (n.module or "").split(".")[0] == "integrations"
        and any(a.name == "use_experts_implementation" and a.asname is None for a in n.names)
        for n in tree.body
    )


BLOCK = "Qwen3VLMoeTextSparseMoeBlock"


def probe(tree: ast.Module) -> Decision:
    cls = syntax.find_class(tree, EXPERTS)
    forward = syntax.find_function(cls, "forward")
    if cls is None or forward is None:
        return unrecognized(f"no {EXPERTS}.forward in this transformers")
    dense = _dense_products(forward)
    decorators = [ast.unparse(d) for d in cls.decorator_list]
    if decorators == ["use_experts_implementation"] and _imports_decorator(tree):
        if dense:
            return unrecognized(f"{EXPERTS} dispatches on experts_implementation, but calls {dense}")
        return EXPERTS_IMPLEMENTATION.decision(
            f"{EXPERTS} dispatches on experts_implementation, sparse in every mode (transformers 5)"
        )
    init = syntax.find_function(cls, "__init__")
    layout = syntax.empty_shape(init, "gate_up_proj") if init is not None else None
    if layout != LAYOUT:
        return unrecognized(f"{EXPERTS}.gate_up_proj is built as {layout}, not (E, H, 2I)")
    if not decorators and syntax.parameters(forward) == SIGNATURE and {"repeat", "bmm"} <= set(dense):
        return DENSE_EVAL.decision(f"{EXPERTS}.forward runs every expert on every token in eval, loops in training")
    return unrecognized(f"{EXPERTS}.forward matches neither transformers 4.57's nor 5's")


def replaced_on_npu(devices: dict[str, bool]) -> str | None:
    """On Ascend, verl's npu_patch sets its own block in place of transformers' (and, with it, these experts)."""
    npu_patch = environment.tree(NPU_PATCH) if devices.get("npu") else None
    if npu_patch is not None and syntax.assigns_attribute(npu_patch, BLOCK):
        return f"verl's npu_patch replaces {BLOCK}, and with it these experts, on this NPU machine"
    return None


def _apply(module: ModuleType, decision: Decision) -> None:
    from verl_qwen3vl_plugin.patches.qwen3_vl_moe_sparse_experts.replacement import sparse_experts_forward

    originals.replace(getattr(module, EXPERTS), "forward", sparse_experts_forward)


DETAILS = """\
**Seen.** verl computes old and reference log-probs in eval mode (verl 0.7's `DataParallelPPOActor.compute_log_prob`
calls `.eval()`, verl 0.9's engine has `eval_mode`). Because the two modes run different kernels, the recomputed "old"
log-probs differ from the training forward's even on-policy. Through verl 0.7.1's own actor on a tiny model with an
image, in bf16, they differed by up to 0.031 without the plugin (0 in fp32 at that size). FLOPs and measured times of
the dense and sparse paths: `docs/performance.md`.

**Details of the change.** Through verl's actor, `compute_log_prob` and the training forward of `update_policy` give
identical log-probs with the plugin, so the on-policy ratio is exactly 1, in fp32 and bf16
(`tests/patches/qwen3_vl_moe_sparse_experts/test_actor.py`). The parameters keep their layout, so FSDP2 sharding,
checkpoints and the weight sync are untouched. `tests/patches/qwen3_vl_moe_sparse_experts/test_numerics.py` checks
both paths, the grouped GEMM and the forced fallback, against transformers' loop (training) and dense path (eval):
outputs and the input, routing-weight and parameter gradients in fp32, and bf16 against the fp32 reference.
`tests/patches/qwen3_vl_moe_sparse_experts/test_gate.py` checks where `torch._grouped_mm` is used.

**Upstream plan.** transformers#42697 (batched and grouped experts implementations, transformers 5) is the anchor:
this is its grouped path for 4.57's layout. It could go into a transformers 4.57.x patch release as
`Qwen3VLMoeTextExperts.forward`, or into the Qwen3-VL-MoE branch of verl's `apply_monkey_patch` for stacks on 4.57,
or stay here. PR title: `[model] perf: grouped-GEMM Qwen3-VL-MoE experts in train and eval for transformers 4.57`.
The numeric tests would run against the in-tree forward, and the actor test would go to a `*_on_cpu.py` file beside
verl's actor tests.
"""

PATCH = Patch(
    name="qwen3_vl_moe_sparse_experts",
    title="grouped Qwen3-VL-MoE experts in training and eval (transformers 4.57.x)",
    group=MODEL,
    targets=(
        Target(module=QWEN3_VL_MOE.modeling, probe=probe, apply=_apply, shapes=(DENSE_EVAL, EXPERTS_IMPLEMENTATION)),
    ),
    why=(
        "transformers 4.57's Qwen3-VL-MoE experts run every expert on every token in eval, which is how verl "
        "computes old and reference log-probs (E / top_k = 16x the expert FLOPs for Qwen3-VL-30B-A3B), and loop "
        "over experts in Python in training; the two modes also give different log-probs for the same input."
    ),
    how=(
        "verl_qwen3vl_plugin.patches.qwen3_vl_moe_sparse_experts.replacement.sparse_experts_forward"
        " replaces the experts' forward: "
        "pairs sorted by expert, one grouped GEMM per projection, the same kernels and bits in training and eval."
    ),
    upstream=("transformers#42697",),
    remove_when="transformers >= 5 (sparse experts_implementation) is the oldest transformers Qwen3-VL-MoE runs on.",
    details=DETAILS,
    dormant=replaced_on_npu,
)
