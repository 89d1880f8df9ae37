"""Targets of ``npu_qwen3_vl_moe_weight_sync``: ``verl.workers.engine.fsdp.utils``, which defines
``unfuse_moe_params``, and ``transformer_impl``, which binds the name at its own import (``from .utils import
unfuse_moe_params``), so the name it calls is wrapped too. A third target, ``FSDPEngine.get_per_tensor_param_shard``,
is only reported on: a flat shard cannot be transposed where it is cut.

- ``SPLITS_TF5_LAYOUT``: ``unfuse_moe_params(weights, ..., model_type, ...)`` (the wrapper reads those two and passes
  every argument through) matches ``.mlp.experts.gate_up_proj`` and cuts it with ``chunk(2, dim=1)``;
  ``FSDPEngine.get_per_tensor_param`` passes its stream through it once, as ``per_tensor_param =
  unfuse_moe_params(per_tensor_param, <model type>)``; and ``NPUQwen3VLMoeTextExperts.__init__`` builds
  ``gate_up_proj`` as ``(num_experts, hidden_size, 2 * expert_dim)``.
- ``NPU_EXPERTS_TF5_LAYOUT``: on any target, the NPU experts build ``gate_up_proj`` as ``(num_experts,
  2 * expert_dim, hidden_size)``, the layout the split assumes.
- ``SENDS_AS_STORED``: no ``unfuse_moe_params``, and every value ``get_per_tensor_param`` assigns to
  ``per_tensor_param`` is ``params``, ``params.items()``, a generator of ``(name, <expression>)`` over
  ``params.items()`` that keeps each name, or ``quantize_with_fusion(per_tensor_param, ...)``. Packed experts then go
  out as stored, which for verl's NPU block is the checkpoint layout vLLM loads.
- ``SHARD_EXPORT_AS_STORED``: the only ``FSDPEngine`` methods that mention ``state_dict`` are
  ``STATE_DICT_READERS``, the module defines a shard export (``SHARD_EXPORTS``), which sends packed experts in their
  stored layout, and the NPU experts keep ``SPLITS_TF5_LAYOUT``'s layout. Its verdict is ``unrecognized``: the doctor
  reports it.
- ``NO_SHARD_EXPORT``: the same known readers, and no shard export anywhere in the module.
"""

from __future__ import annotations

import ast
from types import ModuleType

from verl_qwen3vl_plugin import environment, originals, syntax
from verl_qwen3vl_plugin.registry import NPU, Decision, Patch, Shape, Target, Verdict, unrecognized
from verl_qwen3vl_plugin.upstream import FSDP_ENGINE, FSDP_ENGINE_UTILS, NPU_PATCH
from verl_qwen3vl_plugin.weight_streams import keeps_names

FUNCTION = "unfuse_moe_params"
EXPERTS = "NPUQwen3VLMoeTextExperts"
ENGINE = "FSDPEngine"
STREAM = "per_tensor_param"
SHARD_EXPORT = "get_per_tensor_param_shard"
# FSDPEngine's methods that read the module's state dict in the known releases: building, the full export, the shard
# export and the merged-LoRA export.
STATE_DICT_READERS = {"_build_fsdp_module", "get_per_tensor_param", SHARD_EXPORT, "_merged_lora_per_tensor_param"}
# The shard and delta exports: not used only where no class of the module defines either.
SHARD_EXPORTS = {SHARD_EXPORT, "get_per_tensor_param_delta_shard"}


SHARD_EXPORT_AS_STORED = Shape(
    id="shard-export-delta-checkpoint-engines-export", verdict=Verdict.UNRECOGNIZED, verl=">=0.9"
)
NPU_EXPERTS_TF5_LAYOUT = Shape(
    id="npu-experts-tf5-layout",
    verdict=Verdict.FIXED_UPSTREAM,
    elsewhere="no release yet: verl's NPU experts built in transformers 5's layout",
)
SENDS_AS_STORED = Shape(id="verl0.8-sends-as-stored", verdict=Verdict.NOT_USED, verl="<0.9")
SPLITS_TF5_LAYOUT = Shape(id="verl0.9-splits-tf5-layout", verdict=Verdict.APPLY, verl=">=0.9")
NO_SHARD_EXPORT = Shape(id="verl0.8-no-shard-export", verdict=Verdict.NOT_USED, verl="<0.9")


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


def _stream_values(method: ast.FunctionDef) -> list[ast.expr]:
    return [
        n.value
        for n in ast.walk(method)
        if isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets] == [STREAM]
    ]


def _quantizes(value: ast.expr) -> bool:
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Attribute)
        and value.func.attr == "quantize_with_fusion"
        and [ast.unparse(a) for a in value.args[:1]] == [STREAM]
    )


def _unfuses(value: ast.expr) -> bool:
    """``unfuse_moe_params(per_tensor_param, <model type>)``, by the module's name."""
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id == FUNCTION
        and len(value.args) == 2
        and not value.keywords
        and ast.unparse(value.args[0]) == STREAM
    )


def _per_tensor_param(caller: ast.Module | None) -> ast.FunctionDef | None:
    return syntax.find_function(syntax.find_class(caller, ENGINE), "get_per_tensor_param")


def _stream_shape(method: ast.FunctionDef) -> str | None:
    """ "stored" (verl 0.7 / 0.8), "unfused" (verl 0.9), or None: a stream built some other way."""
    values = _stream_values(method)
    unfused = [v for v in values if _unfuses(v)]
    if not values or not all(keeps_names(v) or _quantizes(v) or _unfuses(v) for v in values):
        return None
    if not unfused and not syntax.calls(method, FUNCTION):
        return "stored"
    return "unfused" if len(unfused) == 1 and len(syntax.call_nodes(method, FUNCTION)) == 1 else None


def npu_experts_layout() -> Decision | None:
    """None when verl's NPU experts keep transformers 4.57's layout (the affected case), else the verdict."""
    init = syntax.find_function(syntax.find_class(environment.tree(NPU_PATCH), EXPERTS), "__init__")
    if init is None:
        return unrecognized(f"no {EXPERTS}.__init__ in verl's npu_patch")
    shape = syntax.empty_shape(init, "gate_up_proj")
    if shape == ["self.num_experts", "self.hidden_size", "2 * self.expert_dim"]:
        return None
    if shape == ["self.num_experts", "2 * self.expert_dim", "self.hidden_size"]:
        return NPU_EXPERTS_TF5_LAYOUT.decision(f"{EXPERTS} stores transformers 5's (E, 2I, H) layout")
    return unrecognized(f"{EXPERTS}.gate_up_proj is built as {shape}")


def _streams_as_stored(caller: ast.Module | None) -> Decision:
    method = _per_tensor_param(caller)
    if method is None:
        return unrecognized(f"no {ENGINE}.get_per_tensor_param in {FSDP_ENGINE}")
    if _stream_shape(method) == "stored":
        return SENDS_AS_STORED.decision("get_per_tensor_param sends packed experts as they are stored (verl 0.7/0.8)")
    return unrecognized("get_per_tensor_param builds its stream neither as verl 0.7/0.8 nor 0.9 do")


def probe_utils(tree: ast.Module) -> Decision:
    func = syntax.find_function(tree, FUNCTION)
    if func is None:
        return _streams_as_stored(environment.tree(FSDP_ENGINE))
    parameters = syntax.parameters(func)
    if parameters[:1] != ["weights"] or "model_type" not in parameters:  # what the wrapper reads; the rest pass
        return unrecognized(f"{FUNCTION} is not (weights, ..., model_type, ...)")
    if not (syntax.has_string(func, ".mlp.experts.gate_up_proj") and _splits_transformers5_layout(func)):
        return unrecognized(f"{FUNCTION} does not split gate_up_proj with chunk(2, dim=1)")
    return npu_experts_layout() or SPLITS_TF5_LAYOUT.decision(
        f"{FUNCTION} assumes (E, 2I, H); verl's {EXPERTS} is (E, H, 2I): split by its own layout"
    )


def probe_caller(tree: ast.Module) -> Decision:
    method = _per_tensor_param(tree)
    if method is None or _stream_shape(method) != "unfused":
        return _streams_as_stored(tree)  # verl 0.7 / 0.8's stream, or nothing known
    utils = environment.tree(FSDP_ENGINE_UTILS)
    if syntax.find_function(utils, FUNCTION) is None:
        return unrecognized(f"get_per_tensor_param calls {FUNCTION}, which {FSDP_ENGINE_UTILS} lacks")
    return probe_utils(utils)


def probe_shard_export(tree: ast.Module) -> Decision:
    engine = syntax.find_class(tree, ENGINE)
    if engine is None:
        return unrecognized(f"no {ENGINE} in {FSDP_ENGINE}")
    readers = {f.name for f in engine.body if isinstance(f, ast.FunctionDef) and syntax.mentions(f, "state_dict")}
    unknown = sorted(readers - STATE_DICT_READERS)
    if unknown:
        return unrecognized(f"{ENGINE}.{', '.join(unknown)} read the state dict in an unknown way")
    exports = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name in SHARD_EXPORTS}
    if not exports:
        return NO_SHARD_EXPORT.decision(f"{ENGINE} has no shard export (verl 0.7/0.8)")
    layout = npu_experts_layout()
    if layout is not None:
        return layout
    return SHARD_EXPORT_AS_STORED.decision(
        f"{SHARD_EXPORT} (the delta checkpoint engine's export) sends verl's NPU experts in their (E, H, 2I) layout "
        "under transformers 5's names; not patched: use the full weight sync for Qwen3-VL-MoE on Ascend"
    )


def _apply(module: ModuleType, decision: Decision) -> None:
    from verl_qwen3vl_plugin.patches.npu_qwen3_vl_moe_weight_sync.replacement import layout_aware

    if not originals.ours(getattr(module, FUNCTION)):  # the caller binds utils' name at import: maybe ours
        originals.wrap(module, FUNCTION, layout_aware)


DETAILS = """\
**Seen.** For Qwen3-VL-30B-A3B (hidden 2048, expert intermediate 768) `gate_proj` arrives as (1024, 1536) instead of
(768, 2048), so the first sync fails. Checkpoints still load into verl's NPU block, because transformers 5's
`Transpose(check_dims=True)` conversion skips the transpose when the shapes already match.
`tests/patches/npu_qwen3_vl_moe_weight_sync/test_weight_sync.py` runs verl 0.9.1's real
`FSDPEngine.get_per_tensor_param` on the CPU with transformers 5.10.4. Without the plugin the per-expert tensors are
wrong in shape at hidden 32 and intermediate 24, and in value at intermediate 16. With it, each tensor sent is
`torch.equal` to what verl sends for transformers 5's own model with the same weights.

**Details of the change.** The transpose is a view, nothing copied. It happens when the model type is `qwen3_vl_moe`
and transformers' module builds verl's NPU block, which `apply_npu_patches()` swaps in for every model of the
process. The doctor reports the shard export as unrecognized on Ascend: use the full weight sync there.

**verl 0.8.** Its wheel sends the packed tensors as stored, which for verl's NPU block is the checkpoint layout vLLM's
Qwen3-VL-MoE loader reads, so the Ascend sync is not mis-split. The release/v0.8.0 branch (after the 0.8.0 wheel, not
on PyPI) backports verl#6896 as verl#6923: `_iter_vllm_compatible_moe_params` in
`verl/workers/rollout/vllm_rollout/vllm_rollout.py`, applied in `ServerAdapter.update_weights` for vLLM <= 0.24.0,
splits with the same `chunk(2, dim=1)`. A build from that branch has the same Ascend bug, which the plugin does not
patch: a release from it would need a third target.

**verl's NPU block against transformers 5's.** On the CPU reference ops (verl 0.8.0 with transformers 5.3.0, verl
0.9.1 with 5.10.4) outputs and gradients agree within 1e-5, the tests mapping the layout with `npu_layout`
(`verl_qwen3vl_plugin/selftest/moe_blocks.py`). Two differences are left alone. transformers 5.3.0 keeps the
renormalised top-k weights in fp32 where verl's block casts them to the logits' dtype (in bf16 up to 0.016 apart in
one block; 5.10.4 casts as verl does). verl's block has no `Qwen3VLMoeTextTopKRouter`, so `output_router_logits=True`
fails, which verl never passes.

**Upstream plan.** `unfuse_moe_params` in `verl/workers/engine/fsdp/utils.py` would take the layout from the module
that holds each tensor, or verl's NPU experts would store transformers 5's layout under transformers 5. verl's NPU
maintainers should check which. PR title:
`[fsdp, hardware] fix: unfuse NPU Qwen3-VL-MoE experts by their own layout in weight sync`. The test (verl's real
`get_per_tensor_param` on the CPU reference ops) would go to a `*_on_cpu.py` file beside verl's engine tests.
"""

PATCH = Patch(
    name="npu_qwen3_vl_moe_weight_sync",
    title="Ascend Qwen3-VL-MoE experts split by their own layout in the weight sync",
    group=NPU,
    targets=(
        *(
            Target(
                module=module,
                probe=probe,
                apply=_apply,
                reads=(other, NPU_PATCH),
                shapes=(SPLITS_TF5_LAYOUT, SENDS_AS_STORED, NPU_EXPERTS_TF5_LAYOUT),
            )
            for module, probe, other in (
                (FSDP_ENGINE_UTILS, probe_utils, FSDP_ENGINE),
                (FSDP_ENGINE, probe_caller, FSDP_ENGINE_UTILS),
            )
        ),
        Target(
            module=FSDP_ENGINE,
            probe=probe_shard_export,
            apply=None,
            name=f"{ENGINE}.{SHARD_EXPORT}",
            reads=(NPU_PATCH,),
            shapes=(SHARD_EXPORT_AS_STORED, NO_SHARD_EXPORT, NPU_EXPERTS_TF5_LAYOUT),
        ),
    ),
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
    details=DETAILS,
)
