"""Patch ``npu_qwen3_vl_moe_sparse_eval``: verl's Ascend Qwen3-VL-MoE experts run their grouped path in eval too.

Target: ``verl.models.transformers.npu_patch`` (imported by verl on Ascend only). Known shapes:
- verl 0.7.0 to 0.9.1 (affected): ``NPUQwen3VLMoeTextExperts.forward`` permutes tokens and calls ``NPUGmmFunction``
  when training, and otherwise repeats every token for every expert and multiplies with ``torch.bmm``;
- fixed: a forward that permutes tokens and has no ``bmm`` (grouped in every mode).
"""

from __future__ import annotations

import ast
from types import ModuleType

from verl_qwen3vl_plugin import compat
from verl_qwen3vl_plugin.registry import NPU, Decision, Patch, Target, Verdict

TARGET = "verl.models.transformers.npu_patch"
EXPERTS = "NPUQwen3VLMoeTextExperts"
GMM = "NPUGmmFunction"


def decide(tree: ast.Module) -> Decision:
    forward = compat.find_function(compat.find_class(tree, EXPERTS), "forward")
    if forward is None or compat.find_class(tree, GMM) is None:
        return Decision(Verdict.UNRECOGNIZED, f"no {EXPERTS}.forward or {GMM} in verl's npu_patch")
    if not compat.calls(forward, "npu_moe_token_permute"):
        return Decision(Verdict.UNRECOGNIZED, f"{EXPERTS}.forward does not permute tokens by expert")
    if not compat.calls(forward, "bmm"):
        return Decision(Verdict.FIXED_UPSTREAM, f"{EXPERTS}.forward is grouped in every mode")
    branch = next((n for n in forward.body if isinstance(n, ast.If) and ast.unparse(n.test) == "self.training"), None)
    if branch is not None and compat.calls(ast.Module(branch.orelse, []), "bmm"):
        return Decision(Verdict.APPLY, f"{EXPERTS}.forward runs every expert on every token when not training")
    return Decision(Verdict.UNRECOGNIZED, f"{EXPERTS}.forward uses bmm outside its eval branch")


def _apply(module: ModuleType) -> None:
    from verl_qwen3vl_plugin.models.npu_qwen3_vl_moe import grouped_eval_forward

    experts = getattr(module, EXPERTS)
    experts.forward = grouped_eval_forward(experts.forward, getattr(module, GMM))


PATCH = Patch(
    name="npu_qwen3_vl_moe_sparse_eval",
    group=NPU,
    targets=(Target(TARGET, decide, _apply),),
    devices=("npu",),
    why=(
        "verl's Ascend Qwen3-VL-MoE experts run every expert on every token in eval, which is how verl computes old "
        "and reference log-probs: E / top_k times the expert FLOPs and E copies of the tokens per layer."
    ),
    how=(
        "verl_qwen3vl_plugin.models.npu_qwen3_vl_moe.grouped_eval_forward: in eval, the experts' own grouped path "
        "(token permute, verl's grouped matmul, unpermute with the top-k weights); training is verl's forward."
    ),
    upstream=("verl#6131",),
    remove_when="verl's NPUQwen3VLMoeTextExperts.forward is grouped in eval.",
    selftest="verl_qwen3vl_plugin.selftest.npu_moe",
)
