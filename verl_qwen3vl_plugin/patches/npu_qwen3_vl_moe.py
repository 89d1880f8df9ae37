"""Patch: always scatter the routing weights in verl's ``NPUQwen3VLMoeTextSparseMoeBlock.forward`` (Ascend).

Why: verl 0.7.1's block builds the dense routing matrix only in eval, while its experts read it in training too
(see ``verl_qwen3vl_plugin.models.npu_qwen3_vl_moe``).
How: a post-import hook on ``verl.models.transformers.npu_patch`` (which verl imports only on Ascend) reads that
module's source and replaces the block's ``forward`` only when both halves of the mismatch are there. verl 0.7.0
(experts take the top-k weights directly) and verl >= 0.8 (always scatters, PR #6131) are left alone. No NPU probe
here: the decision is the same on any machine, so it is tested on the CPU.
Remove when: verl 0.7.1 is no longer run on Ascend.
"""

from __future__ import annotations

import ast
from types import ModuleType

from packaging.version import Version

from verl_qwen3vl_plugin.compat import dist_version, module_source
from verl_qwen3vl_plugin.registry import NPU_MOE_ROUTING, Status, disabled_verdict, on_import, record, start_install

NAME = NPU_MOE_ROUTING
TARGET = "verl.models.transformers.npu_patch"
BLOCK = "NPUQwen3VLMoeTextSparseMoeBlock"
EXPERTS = "NPUQwen3VLMoeTextExperts"
KNOWN_AFFECTED = Version("0.7.1")


def _method(tree: ast.Module, cls_name: str, method: str) -> ast.FunctionDef | None:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    return item
    return None


def _is_not_training(test: ast.expr) -> bool:
    return (
        isinstance(test, ast.UnaryOp)
        and isinstance(test.op, ast.Not)
        and isinstance(test.operand, ast.Attribute)
        and test.operand.attr == "training"
    )


def _calls(node: ast.AST, attr: str) -> bool:
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attr for n in ast.walk(node)
    )


def _reads_dense_by_token(node: ast.AST) -> bool:
    """``routing_weights[token_idx, router_indices]``: a 2-D gather from the dense (tokens, experts) matrix."""
    return any(
        isinstance(n, ast.Subscript)
        and isinstance(n.value, ast.Name)
        and n.value.id == "routing_weights"
        and isinstance(n.slice, ast.Tuple)
        and len(n.slice.elts) == 2
        for n in ast.walk(node)
    )


def decide_source(source: str | None) -> tuple[Status, str]:
    """Decide from verl's ``npu_patch.py`` source (None: unreadable, then the verl version decides)."""
    disabled = disabled_verdict(NAME)
    if disabled:
        return disabled
    verl = dist_version("verl")
    if source is None:
        if verl == KNOWN_AFFECTED:
            return Status.APPLIED, f"npu_patch source unreadable; verl {verl} is known to drop training routing"
        return Status.FIXED_UPSTREAM, f"npu_patch source unreadable; verl {verl} is not known to be affected"
    tree = ast.parse(source)
    block, experts = _method(tree, BLOCK, "forward"), _method(tree, EXPERTS, "forward")
    if block is None or experts is None:
        return Status.NOT_USED, f"verl {verl} has no {BLOCK} in its NPU patches"
    eval_only_scatter = any(
        isinstance(n, ast.If) and _is_not_training(n.test) and _calls(n, "scatter_") for n in ast.walk(block)
    )
    if not eval_only_scatter:
        return Status.FIXED_UPSTREAM, f"verl {verl}: {BLOCK}.forward scatters routing weights in every mode"
    if not _reads_dense_by_token(experts):
        return Status.FIXED_UPSTREAM, f"verl {verl}: {EXPERTS} takes the top-k weights directly in training"
    return Status.APPLIED, f"verl {verl}: {BLOCK}.forward scatters routing weights only in eval; fixed to always"


def decide_installed() -> tuple[Status, str]:
    """The decision for the installed verl, without importing its npu_patch (which needs torch_npu)."""
    return decide_source(module_source(TARGET))


def _on_npu_patch(module: ModuleType) -> None:
    try:
        source = open(module.__file__).read()
    except (OSError, TypeError):
        source = None
    status, reason = decide_source(source)
    if status is Status.APPLIED:
        from verl_qwen3vl_plugin.models.npu_qwen3_vl_moe import sparse_moe_block_forward

        getattr(module, BLOCK).forward = sparse_moe_block_forward
    record(NAME, status, reason)


def install() -> None:
    """Register the post-import hook on verl's NPU patch module (once per process)."""
    if start_install(NAME, f"waiting for {TARGET} (verl imports it on Ascend only)"):
        on_import(NAME, TARGET, _on_npu_patch)
