"""Patch ``npu_qwen3_vl_moe_weight_sync``: split verl's NPU Qwen3-VL-MoE experts by their own layout in the weight
sync to the rollout (Ascend, verl >= 0.9).

verl 0.9's FSDP engine streams the state dict through ``unfuse_moe_params`` (``verl.workers.engine.fsdp.utils``),
which cuts each packed ``mlp.experts.gate_up_proj`` with ``chunk(2, dim=1)``: transformers 5's ``(E, 2I, H)``
layout. On Ascend, verl's ``NPUQwen3VLMoeTextSparseMoeBlock`` replaces transformers' block and keeps transformers
4.57's ``(E, H, 2I)`` / ``(E, I, H)``, so the rollout receives mis-split experts.

Targets: ``utils`` (the function) and ``transformer_impl``, which binds the name at its own import (``from .utils
import unfuse_moe_params``), so the name it calls is replaced too. The probes read verl's code: the split that assumes
transformers 5's layout, the caller, and the NPU experts' own layout (in ``npu_patch``).
"""

from __future__ import annotations

import ast
from types import ModuleType

from verl_qwen3vl_plugin import compat
from verl_qwen3vl_plugin.registry import NPU, Decision, Patch, Target, Verdict

UTILS = "verl.workers.engine.fsdp.utils"
CALLER = "verl.workers.engine.fsdp.transformer_impl"
NPU_PATCH = "verl.models.transformers.npu_patch"
FUNCTION = "unfuse_moe_params"
EXPERTS = "NPUQwen3VLMoeTextExperts"


def _empty_shape(init: ast.FunctionDef, parameter: str) -> list[str] | None:
    """``self.<parameter> = nn.Parameter(torch.empty(<dims>))``: the dims as source text."""
    for node in ast.walk(init):
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Attribute) and t.attr == parameter for t in node.targets)
            and isinstance(node.value, ast.Call)
            and node.value.args
            and isinstance(empty := node.value.args[0], ast.Call)
            and compat.calls(empty, "empty")
        ):
            dims = empty.args[0].elts if len(empty.args) == 1 and isinstance(empty.args[0], ast.Tuple) else empty.args
            return [ast.unparse(d) for d in dims]
    return None


def npu_experts_layout() -> Decision | None:
    """None when verl's NPU experts keep transformers 4.57's layout (the affected case), else the verdict."""
    tree = compat.parse_module(NPU_PATCH)
    init = compat.find_function(compat.find_class(tree, EXPERTS), "__init__") if tree else None
    if init is None:
        return Decision(Verdict.UNRECOGNIZED, f"no {EXPERTS}.__init__ in verl's npu_patch")
    shape = _empty_shape(init, "gate_up_proj")
    if shape == ["self.num_experts", "self.hidden_size", "2 * self.expert_dim"]:
        return None
    if shape == ["self.num_experts", "2 * self.expert_dim", "self.hidden_size"]:
        return Decision(Verdict.FIXED_UPSTREAM, f"{EXPERTS} stores transformers 5's (E, 2I, H) layout")
    return Decision(Verdict.UNRECOGNIZED, f"{EXPERTS}.gate_up_proj is built as {shape}")


def _splits_transformers5_layout(func: ast.FunctionDef) -> bool:
    """``<tensor>.chunk(2, dim=1)``: gate and up cut along the second axis, as transformers 5 packs them."""
    return any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "chunk"
        and [ast.unparse(a) for a in n.args] == ["2"]
        and [(k.arg, ast.unparse(k.value)) for k in n.keywords] == [("dim", "1")]
        for n in ast.walk(func)
    )


def _streams_as_stored(caller: ast.Module | None) -> Decision:
    """verl 0.7 / 0.8: ``get_per_tensor_param`` sends packed experts as they are stored (verl's NPU block: the
    checkpoint layout, which vLLM's loader reads). Anything but that shape or verl 0.9's call is unrecognized."""
    method = compat.find_function(compat.find_class(caller, "FSDPEngine"), "get_per_tensor_param") if caller else None
    if method is None:
        return Decision(Verdict.UNRECOGNIZED, f"no FSDPEngine.get_per_tensor_param in {CALLER}")
    if compat.calls(method, FUNCTION) or compat.mentions(method, "gate_up_proj"):
        return Decision(Verdict.UNRECOGNIZED, "get_per_tensor_param splits packed experts, not as verl 0.9 does")
    return Decision(Verdict.NOT_USED, "get_per_tensor_param sends packed experts as they are stored")


def decide_utils(tree: ast.Module) -> Decision:
    func = compat.find_function(tree, FUNCTION)
    if func is None:
        return _streams_as_stored(compat.parse_module(CALLER))
    if not (compat.has_string(func, ".mlp.experts.gate_up_proj") and _splits_transformers5_layout(func)):
        return Decision(Verdict.UNRECOGNIZED, f"{FUNCTION} does not split gate_up_proj with chunk(2, dim=1)")
    return npu_experts_layout() or Decision(
        Verdict.APPLY, f"{FUNCTION} assumes (E, 2I, H); verl's {EXPERTS} is (E, H, 2I): split by its own layout"
    )


def decide_caller(tree: ast.Module) -> Decision:
    method = compat.find_function(compat.find_class(tree, "FSDPEngine"), "get_per_tensor_param")
    if method is None or not compat.calls(method, FUNCTION):
        return _streams_as_stored(tree)
    utils = compat.parse_module(UTILS)
    if utils is None or compat.find_function(utils, FUNCTION) is None:
        return Decision(Verdict.UNRECOGNIZED, f"get_per_tensor_param calls {FUNCTION}, which {UTILS} lacks")
    return decide_utils(utils)


def _npu_block_in_use() -> bool:
    """Whether transformers' Qwen3-VL-MoE module builds verl's NPU block (what ``apply_npu_patches`` swaps in)."""
    import sys

    npu_patch = sys.modules.get(NPU_PATCH)
    modeling = sys.modules.get("transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe")
    block = getattr(npu_patch, "NPUQwen3VLMoeTextSparseMoeBlock", None)
    return block is not None and getattr(modeling, "Qwen3VLMoeTextSparseMoeBlock", None) is block


def _layout_aware(unfuse):
    def unfuse_moe_params(weights, model_type: str | None = None):
        """verl's ``unfuse_moe_params``, fed verl's NPU Qwen3-VL-MoE experts in transformers 5's layout."""
        if model_type == "qwen3_vl_moe" and _npu_block_in_use():
            from verl_qwen3vl_plugin.models.npu_qwen3_vl_moe import experts_to_transformers5_layout

            weights = experts_to_transformers5_layout(weights)
        return unfuse(weights, model_type)

    unfuse_moe_params.__wrapped__ = unfuse
    return unfuse_moe_params


def _apply(module: ModuleType) -> None:
    current = getattr(module, FUNCTION)
    if current.__module__ != __name__:  # the caller binds utils' name at import: it may hold the replacement already
        setattr(module, FUNCTION, _layout_aware(current))


PATCH = Patch(
    name="npu_qwen3_vl_moe_weight_sync",
    group=NPU,
    targets=(Target(UTILS, decide_utils, _apply), Target(CALLER, decide_caller, _apply)),
    devices=("npu",),
    why=(
        "verl 0.9's weight sync splits packed experts as transformers 5 lays them out, while verl's Ascend "
        "Qwen3-VL-MoE block keeps transformers 4.57's layout: the first sync fails on a shape mismatch, or, when "
        "hidden == 2 * moe_intermediate, the rollout silently gets scrambled experts."
    ),
    how=(
        "unfuse_moe_params, where verl defines it and where the FSDP engine calls it, first transposes the NPU "
        "block's gate_up_proj and down_proj to transformers 5's layout, then runs verl's own split."
    ),
    upstream=("verl#6896", "verl#6923"),
    remove_when="verl's NPU Qwen3-VL-MoE block stores transformers 5's expert layout, or its weight sync reads it.",
    selftest="verl_qwen3vl_plugin.selftest.npu_moe",
)
