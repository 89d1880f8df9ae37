"""Targets of ``qwen3_vl_moe_routing_replay``: the routers (transformers' Qwen3-VL-MoE sparse block or top-k router,
Qwen3.5-MoE's top-k router, verl's NPU block), which take their top-k ids from the micro-batch's record, and the verl
code that lays out the tokens (the legacy actor and its worker, or the FSDP engine), which lays the record out alike.
Each wrapper calls upstream's code unchanged unless the actor's (or engine's) own ``router_replay.mode`` is R2 or R3,
and the routers call upstream's forward unless a micro-batch's routes cover them.

- ``BLOCK_ROUTES``: ``Qwen3VLMoeTextSparseMoeBlock.forward(self, hidden_states)`` calls ``self.gate``, ``softmax``
  and ``topk``, calls ``self.experts`` with three arguments (hidden states, routing weights, indices) and returns a
  pair. ``NO_TOP_K_ROUTER``: that block, and no ``Qwen3VLMoeTextTopKRouter``.
- ``BLOCK_TAKES_ROUTER_ROUTES``: the block's forward calls ``self.gate`` and no ``topk``, and the module defines
  ``Qwen3VLMoeTextTopKRouter``, whose target acts.
- ``RETURNS_PROBABILITIES`` and ``RETURNS_LOGITS``: a top-k router's ``forward(self, hidden_states)`` calls ``linear``
  on ``self.weight``, ``softmax`` and ``topk`` and returns three values. ``RETURNS_PROBABILITIES``'s assigns the
  softmax to ``router_logits``, so its first value is the probabilities, and ``RETURNS_LOGITS``'s does not. Replay
  returns the first value alike.
- ``NPU_BLOCK_ROUTES``: ``NPUQwen3VLMoeTextSparseMoeBlock.forward`` has ``BLOCK_ROUTES``'s shape but returns the
  experts' output alone, keyed by the ``npu_qwen3_vl_moe_routing`` shape of the block and its experts. On its
  ``TOP_K_EXPERTS`` the experts read top-k weights in training, and replay hands them those.
- ``ACTOR_WITHOUT_REPLAY``: ``DataParallelPPOActor._forward_micro_batch(self, micro_batch, ...)`` calls every one of
  ``ACTOR_LAYOUT``, ``compute_log_prob(self, data, ...)`` and ``update_policy(self, data, ...)`` call ``select``, and
  the class names neither ``routed_experts`` nor ``router_replay``.
- ``WORKER_LOG_PROBS_ONLY``: ``ActorRolloutRefWorker.compute_log_prob(self, data)`` calls
  ``self.actor.compute_log_prob`` and ``from_dict``, and names neither.
- ``ENGINE_WITHOUT_REPLAY``: ``FSDPEngine.forward_backward_batch(self, data, loss_function, forward_only)``,
  ``FSDPEngineWithLMHead.prepare_model_inputs(self, micro_batch)`` calling ``ulysses_pad`` and assigning a
  ``["pad_size"]`` item, and ``prepare_model_outputs(self, output, output_args, micro_batch, ...)``, in classes that
  name neither. ``NO_LEGACY_ACTOR``: no legacy actor or worker module, and that engine.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from types import ModuleType

from verl_qwen3vl_plugin import environment, originals, syntax
from verl_qwen3vl_plugin.families import QWEN3_5_MOE, QWEN3_VL_MOE
from verl_qwen3vl_plugin.family_shapes import absent_family, shipped
from verl_qwen3vl_plugin.patches.npu_qwen3_vl_moe_routing import spec as npu_routing
from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay.settings import (
    ENGINE_SWITCH,
    LEGACY_SWITCH,
    ROLLOUT_SETTING,
)
from verl_qwen3vl_plugin.registry import MODEL, Decision, Patch, Shape, Target, Verdict, unrecognized
from verl_qwen3vl_plugin.upstream import DP_ACTOR, FSDP_ENGINE, FSDP_WORKERS, NPU_PATCH

BLOCK, ROUTER = f"{QWEN3_VL_MOE.prefix}TextSparseMoeBlock", f"{QWEN3_VL_MOE.prefix}TextTopKRouter"
# Qwen3.5-MoE: every decoder layer, gated delta-net or full attention, has a sparse block whose top-k router has the
# shape of Qwen3-VL-MoE's.
QWEN3_5_ROUTER = f"{QWEN3_5_MOE.prefix}TopKRouter"
NPU_BLOCK = f"NPU{BLOCK}"
ACTOR, WORKER = "DataParallelPPOActor", "ActorRolloutRefWorker"
ENGINE_CLASS, ENGINE_LM_CLASS = "FSDPEngine", "FSDPEngineWithLMHead"
UPSTREAM_REPLAY = ("routed_experts", "router_replay")
ACTOR_LAYOUT = ("unpad_input", "ulysses_pad", "gather_outputs_and_unpad", "pad_input")
# The top-k routers' known shapes, the softmax or the logits first. The ids are older than the ranges, which were
# read in the wheels: an id's release need not be its range's first.
RETURNS_PROBABILITIES = Shape(id="tf5.3-router-returns-probabilities", verdict=Verdict.APPLY, transformers=">=5,<5.6")
RETURNS_LOGITS = Shape(id="tf5.8-router-returns-logits", verdict=Verdict.APPLY, transformers=">=5.6")
# verl's NPU block, by the routing it has (the routing patch's probe reads it): replay's experts take its weights in
# the form that routing reads, dense or top-k.
NPU_BLOCK_ROUTES = {
    npu_routing.EVAL_ONLY_SCATTER.id: Shape(
        id="npu-block-routes-itself/verl0.7.1-eval-only-scatter", verdict=Verdict.APPLY, verl="==0.7.1"
    ),
    npu_routing.TOP_K_EXPERTS.id: Shape(
        id="npu-block-routes-itself/verl0.7.0-top-k-experts", verdict=Verdict.APPLY, verl="==0.7.0"
    ),
    npu_routing.ALWAYS_SCATTERS.id: Shape(
        id="npu-block-routes-itself/verl0.8-scatters", verdict=Verdict.APPLY, verl=">=0.8"
    ),
}


BLOCK_ROUTES = Shape(id="tf4.57-block-routes", verdict=Verdict.APPLY, transformers="<5")
BLOCK_TAKES_ROUTER_ROUTES = Shape(id="tf5-block-takes-router-routes", verdict=Verdict.NOT_USED, transformers=">=5")
NO_TOP_K_ROUTER = Shape(id="tf4.57-no-top-k-router", verdict=Verdict.NOT_USED, transformers="<5")
ACTOR_WITHOUT_REPLAY = Shape(id="verl0.7-actor-without-replay", verdict=Verdict.APPLY, verl="<0.8")
WORKER_LOG_PROBS_ONLY = Shape(id="verl0.7-worker-log-probs-only", verdict=Verdict.APPLY, verl="<0.8")
ENGINE_WITHOUT_REPLAY = Shape(id="fsdp-engine-without-replay", verdict=Verdict.APPLY)
NO_LEGACY_ACTOR = Shape(id="verl0.8-no-legacy-actor", verdict=Verdict.NOT_USED, verl=">=0.8")


def _forward(tree: ast.Module | None, cls_name: str) -> ast.FunctionDef | None:
    return syntax.find_function(syntax.find_class(tree, cls_name), "forward")


def _returns(func: ast.FunctionDef) -> list[int]:
    """How many values each ``return`` gives (1 for anything but a tuple display)."""
    return [
        len(n.value.elts) if isinstance(n.value, ast.Tuple) else 1
        for n in ast.walk(func)
        if isinstance(n, ast.Return) and n.value is not None
    ]


def _experts_call(func: ast.FunctionDef) -> bool:
    return any(len(c.args) == 3 and ast.unparse(c.func) == "self.experts" for c in syntax.call_nodes(func, "experts"))


def _routes_itself(forward: ast.FunctionDef | None, returns: int) -> bool:
    """4.57's sparse block shape, and verl's Ascend copy of it."""
    return (
        forward is not None
        and syntax.parameters(forward) == ["self", "hidden_states"]
        and syntax.calls_self(forward, "gate")
        and syntax.calls(forward, "softmax")
        and syntax.calls(forward, "topk")
        and _experts_call(forward)
        and set(_returns(forward)) == {returns}
    )


def probe_sparse_block(tree: ast.Module) -> Decision:
    forward = _forward(tree, BLOCK)
    if _routes_itself(forward, 2):
        return BLOCK_ROUTES.decision(f"{BLOCK} routes its tokens itself (transformers 4.57)")
    if (
        forward is not None
        and syntax.calls_self(forward, "gate")
        and not syntax.calls(forward, "topk")
        and syntax.find_class(tree, ROUTER) is not None
    ):
        return BLOCK_TAKES_ROUTER_ROUTES.decision(f"{BLOCK} takes its routes from {ROUTER} (transformers 5)")
    return unrecognized(f"{BLOCK}.forward routes in an unknown way")


def returns_probabilities(forward: ast.FunctionDef) -> bool:
    """Older transformers 5 releases (5.3 here) overwrite ``router_logits`` with the softmax and return that, with
    the top-k weights in fp32; newer ones return the logits, the weights cast to their dtype. Replay follows each."""
    return any(
        isinstance(n, ast.Assign)
        and [ast.unparse(t) for t in n.targets] == ["router_logits"]
        and isinstance(n.value, ast.Call)
        and syntax.calls(n.value, "softmax")
        for n in ast.walk(forward)
    )


def probe_top_k_router(tree: ast.Module, router: str) -> Decision:
    forward = _forward(tree, router)
    if forward is None:
        return unrecognized(f"no {router}.forward")
    known = (
        syntax.parameters(forward) == ["self", "hidden_states"]
        and any("self.weight" in ast.unparse(c) for c in syntax.call_nodes(forward, "linear"))
        and syntax.calls(forward, "softmax")
        and syntax.calls(forward, "topk")
        and set(_returns(forward)) == {3}
    )
    if not known:
        return unrecognized(f"{router}.forward routes in an unknown way")
    if returns_probabilities(forward):
        return RETURNS_PROBABILITIES.decision(f"{router} returns (probabilities, top-k weights, top-k ids)")
    return RETURNS_LOGITS.decision(f"{router} returns (logits, top-k weights, top-k ids)")


def probe_qwen3_vl_router(tree: ast.Module) -> Decision:
    """transformers 4.57 has no top-k router: its sparse block routes, and the sparse block target acts there."""
    if syntax.find_class(tree, ROUTER) is None and _routes_itself(_forward(tree, BLOCK), 2):
        return NO_TOP_K_ROUTER.decision(f"no {ROUTER}: {BLOCK} routes (transformers 4.57)")
    return probe_top_k_router(tree, ROUTER)


def probe_npu_block(tree: ast.Module) -> Decision:
    """verl's block routes itself, and its routing and experts are one of the known releases' (the routing patch's
    probe): replay hands its experts the weights in the form they read, dense or top-k (0.7.0's training path)."""
    known = npu_routing.probe(tree)
    if known.verdict is Verdict.UNRECOGNIZED:
        return known
    if not _routes_itself(_forward(tree, NPU_BLOCK), 1):
        return unrecognized(f"{NPU_BLOCK}.forward routes in an unknown way")
    return NPU_BLOCK_ROUTES[known.shape].decision(f"{NPU_BLOCK} routes its tokens itself ({known.reason})")


def _no_upstream_replay(*classes: ast.ClassDef) -> bool:
    return not any(syntax.mentions(c, text) for c in classes for text in UPSTREAM_REPLAY)


def _selects(func: ast.FunctionDef | None) -> bool:
    return func is not None and syntax.parameters(func)[:2] == ["self", "data"] and syntax.calls(func, "select")


def probe_actor(tree: ast.Module) -> Decision:
    cls = syntax.find_class(tree, ACTOR)
    step = syntax.find_function(cls, "_forward_micro_batch")
    if step is None or syntax.parameters(step)[:2] != ["self", "micro_batch"]:
        return unrecognized(f"no {ACTOR}._forward_micro_batch(self, micro_batch, ...)")
    if not all(syntax.calls(step, name) for name in ACTOR_LAYOUT):
        return unrecognized(f"{ACTOR}._forward_micro_batch lays out its tokens in an unknown way")
    if not (
        _selects(syntax.find_function(cls, "compute_log_prob")) and _selects(syntax.find_function(cls, "update_policy"))
    ):
        return unrecognized(f"{ACTOR}.compute_log_prob / update_policy do not select their keys")
    if not _no_upstream_replay(cls):
        return unrecognized(f"{ACTOR} handles routing replay itself: review the plugin's")
    return ACTOR_WITHOUT_REPLAY.decision(f"{ACTOR} drops routed_experts and never reads router_replay")


def probe_worker(tree: ast.Module) -> Decision:
    cls = syntax.find_class(tree, WORKER)
    method = syntax.find_function(cls, "compute_log_prob")
    if method is None or syntax.parameters(method) != ["self", "data"]:
        return unrecognized(f"no {WORKER}.compute_log_prob(self, data)")
    builds = any(
        ast.unparse(c.func) == "self.actor.compute_log_prob" for c in syntax.call_nodes(method, "compute_log_prob")
    )
    if not (builds and syntax.calls(method, "from_dict")) or not _no_upstream_replay(method):
        return unrecognized(f"{WORKER}.compute_log_prob builds its output in an unknown way")
    return WORKER_LOG_PROBS_ONLY.decision(f"{WORKER}.compute_log_prob returns log-probs only")


def _sets_pad_size(func: ast.FunctionDef) -> bool:
    return any(
        isinstance(n, ast.Assign)
        and any(isinstance(t, ast.Subscript) and syntax.has_string(t.slice, "pad_size") for t in n.targets)
        for n in ast.walk(func)
    )


def probe_engine(tree: ast.Module | None) -> Decision:
    base, lm = syntax.find_class(tree, ENGINE_CLASS), syntax.find_class(tree, ENGINE_LM_CLASS)
    batch = syntax.find_function(base, "forward_backward_batch")
    inputs = syntax.find_function(lm, "prepare_model_inputs")
    outputs = syntax.find_function(lm, "prepare_model_outputs")
    if batch is None or syntax.parameters(batch) != ["self", "data", "loss_function", "forward_only"]:
        return unrecognized(f"no {ENGINE_CLASS}.forward_backward_batch(self, data, loss_function, forward_only)")
    if (
        inputs is None
        or syntax.parameters(inputs) != ["self", "micro_batch"]
        or not (syntax.calls(inputs, "ulysses_pad") and _sets_pad_size(inputs))
    ):
        return unrecognized(f"{ENGINE_LM_CLASS}.prepare_model_inputs pads its tokens in an unknown way")
    if outputs is None or syntax.parameters(outputs)[:4] != ["self", "output", "output_args", "micro_batch"]:
        return unrecognized(f"no {ENGINE_LM_CLASS}.prepare_model_outputs(self, output, output_args, micro_batch, ...)")
    if not _no_upstream_replay(base, lm):
        return unrecognized("verl's FSDP engine reads router_replay itself: review the plugin's")
    return ENGINE_WITHOUT_REPLAY.decision(
        "verl's FSDP engine never reads router_replay (verl reads it for Megatron and VeOmni)"
    )


def availability(verdicts: dict[str, str]) -> str:
    """Whether routing replay can run on this stack (``verdicts``: target label -> verdict value), how to turn it
    on, or why it cannot: the doctor's line."""
    applies = {label for label, verdict in verdicts.items() if verdict == Verdict.APPLY.value}

    def labels(*modules: str) -> set[str]:
        return {t.label for t in PATCH.targets if t.module in modules}

    if set(verdicts.values()) == {Verdict.DISABLED.value}:
        return "not available: the patch is disabled (VERL_QWEN3VL_PLUGIN_DISABLE)"
    if not applies & labels(QWEN3_VL_MOE.modeling, QWEN3_5_MOE.modeling, NPU_PATCH):
        return "not available: no Qwen3-VL-MoE or Qwen3.5-MoE router the plugin recognises on this stack"
    paths = []
    if labels(DP_ACTOR, FSDP_WORKERS) <= applies:
        paths.append(f"verl's legacy FSDP actor: {LEGACY_SWITCH}=R3 (or R2)")
    if labels(FSDP_ENGINE) <= applies:
        paths.append(f"verl's FSDP engine: {ENGINE_SWITCH}=R3 (or R2)")
    if not paths:
        return "not available: neither verl's legacy FSDP actor nor its FSDP engine is recognised on this stack"
    return (
        "available (off by default); turn on with "
        + "; or, on ".join(paths)
        + f"; R3 also needs {ROLLOUT_SETTING} (vLLM >= 0.22 on verl 0.9.1)"
    )


def _apply_sparse_block(module: ModuleType, decision: Decision) -> None:
    from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay import routers

    routers.patch_sparse_block(module)


def _apply_router(cls_name: str) -> Callable[[ModuleType, Decision], None]:
    def apply(module: ModuleType, decision: Decision) -> None:
        from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay import routers

        routers.patch_top_k_router(getattr(module, cls_name))

    return apply


def _apply_npu(module: ModuleType, decision: Decision) -> None:
    from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay import routers

    top_k = NPU_BLOCK_ROUTES[npu_routing.TOP_K_EXPERTS.id]
    routers.patch_npu_block(module, top_k_in_training=decision.shape == top_k.id)


def _apply_actor(module: ModuleType, decision: Decision) -> None:
    from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay import dp_actor

    cls = getattr(module, ACTOR)
    for method in ("_forward_micro_batch", "compute_log_prob", "update_policy"):
        originals.wrap(cls, method, getattr(dp_actor, method.lstrip("_")))


def _apply_worker(module: ModuleType, decision: Decision) -> None:
    from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay import dp_actor

    originals.wrap(getattr(module, WORKER), "compute_log_prob", dp_actor.worker_compute_log_prob)


def _apply_engine(module: ModuleType, decision: Decision) -> None:
    from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay import engine

    originals.wrap(getattr(module, ENGINE_CLASS), "forward_backward_batch", engine.forward_backward_batch)
    for method in ("prepare_model_inputs", "prepare_model_outputs"):
        originals.wrap(getattr(module, ENGINE_LM_CLASS), method, getattr(engine, method))


def legacy_gone() -> Decision:
    """No legacy actor module: verl >= 0.8, whose FSDP runs train through the engine, if the engine is the known one."""
    engine = probe_engine(environment.tree(FSDP_ENGINE))
    if engine.verdict is not Verdict.APPLY:
        return unrecognized(f"no legacy FSDP actor, and {engine.reason}")
    return NO_LEGACY_ACTOR.decision("no legacy FSDP actor (verl >= 0.8): the FSDP engine target acts")


DETAILS = """\
**Where verl stands.** verl has the rollout half of R3 (`rollout.enable_rollout_routing_replay`: vLLM returns
`routed_experts`, the agent loop puts them on the batch). On FSDP, verl 0.8 and 0.9's worker forces
`router_replay.mode` to `disabled`, and verl 0.7's `DataParallelPPOActor` drops `routed_experts` with its key
selection.

**Turning it on.** On verl 0.7.x set `actor_rollout_ref.actor.router_replay.mode=R3` (or `R2`). On verl 0.8.0 to
0.9.1 set `+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3`, with the `+` because the FSDP engine's YAML
does not declare the group (its config class has it). R3 also needs the rollout's record,
`actor_rollout_ref.rollout.enable_rollout_routing_replay=True`; the doctor's `rollout side:` line says whether the
installed engine records routes. R2 needs nothing from the rollout and must not have it, or the batch would hold two
records.

**Errors, never a silent fallback.** A `ReplayError` (a `ValueError`) names what is wrong: R3 without
`routed_experts` on the batch, R2 with the rollout's record on it, a record of the wrong shape, dtype or expert ids,
an unknown mode, a model with no router the plugin patched (or one replaced after it, as verl's `apply_monkey_patch`
does on transformers <= 4.57.3), verl 0.7's prefix grouper, or `use_remove_padding=False`.

**R3's record check.** Before it replays, R3 checks that the rollout's record lines up with each sample's tokens
(`verl_qwen3vl_plugin/patches/qwen3_vl_moe_routing_replay/rollout_record.py`). A record that does not fit raises,
naming the sample. The usual cause is an engine that expanded an image or video into another number of placeholder
tokens than the HF processor (`min_pixels`, `max_pixels`, video settings). The share of (token, layer) pairs without
a route is `routing_replay/fallback_fraction` in verl's metrics. Above `VERL_QWEN3VL_PLUGIN_R3_MAX_FALLBACK` (default
0.01) it raises, naming the known causes: vLLM 0.22 to 0.26 with monolithic MoE kernels (vLLM #44116, #54730) and
vllm-ascend 0.26.0rc1 (vllm-ascend #16314). With top_k 1 the check is skipped.

**Tests.** `tests/patches/qwen3_vl_moe_routing_replay/` runs verl's actor (0.7) and engine (>= 0.8) on every CI
stack, on a tiny Qwen3-VL-MoE and a tiny Qwen3.5-MoE, with checkpoint recompute, dynamic batching, SP = 2 and two
FSDP2 ranks with different data. Replay off is bit-identical to the plugin without this patch. The rollout half does
not run on the CPU, so the tests build the record as verl's agent loop packs it. Measured mismatch and overhead:
`docs/performance.md`.

**Upstream plan.** verl#4443 (open) is the FSDP proposal to review. `routes.py` and `session.py` would become a new
module beside `verl/utils/veomni/router_replay.py`, and `routers.py` would go into the Qwen3-VL-MoE branch of
`verl/models/transformers/monkey_patch.py` and the NPU block in `npu_patch.py`. `engine.py` maps onto
`forward_backward_batch`, `prepare_model_inputs` and `prepare_model_outputs` in
`verl/workers/engine/fsdp/transformer_impl.py`, with `engine_workers.py` reading `router_replay.mode` for `fsdp`
and `fsdp2` too. `dp_actor.py` maps onto `verl/workers/actor/dp_actor.py` and `fsdp_workers.py` on the release/v0.7
branch. The tests would go to `*_on_cpu.py` files beside verl's engine tests.
"""

PATCH = Patch(
    name="qwen3_vl_moe_routing_replay",
    title="routing replay (R2 / R3) for Qwen3-VL-MoE and Qwen3.5-MoE on verl's FSDP path",
    group=MODEL,
    targets=(
        Target(
            module=QWEN3_VL_MOE.modeling,
            probe=probe_sparse_block,
            apply=_apply_sparse_block,
            name=f"{BLOCK}.forward",
            shapes=(BLOCK_ROUTES, BLOCK_TAKES_ROUTER_ROUTES),
        ),
        Target(
            module=QWEN3_VL_MOE.modeling,
            probe=probe_qwen3_vl_router,
            apply=_apply_router(ROUTER),
            name=f"{ROUTER}.forward",
            shapes=(NO_TOP_K_ROUTER, RETURNS_PROBABILITIES, RETURNS_LOGITS),
        ),
        Target(
            module=QWEN3_5_MOE.modeling,
            probe=lambda tree: probe_top_k_router(tree, QWEN3_5_ROUTER),
            apply=_apply_router(QWEN3_5_ROUTER),
            absent=absent_family(QWEN3_5_MOE).when_absent(QWEN3_5_MOE.missing("transformers")),
            name=f"{QWEN3_5_ROUTER}.forward",
            shapes=(
                absent_family(QWEN3_5_MOE),
                *(s.narrowed(transformers=shipped(QWEN3_5_MOE)) for s in (RETURNS_PROBABILITIES, RETURNS_LOGITS)),
            ),
        ),
        Target(
            module=NPU_PATCH,
            probe=probe_npu_block,
            apply=_apply_npu,
            name=f"{NPU_BLOCK}.forward",
            shapes=tuple(NPU_BLOCK_ROUTES.values()),
        ),
        Target(
            module=DP_ACTOR,
            probe=probe_actor,
            apply=_apply_actor,
            absent=legacy_gone,
            reads=(FSDP_ENGINE,),
            shapes=(ACTOR_WITHOUT_REPLAY, NO_LEGACY_ACTOR),
        ),
        Target(
            module=FSDP_WORKERS,
            probe=probe_worker,
            apply=_apply_worker,
            absent=legacy_gone,
            name=f"{WORKER}.compute_log_prob",
            reads=(FSDP_ENGINE,),
            shapes=(WORKER_LOG_PROBS_ONLY, NO_LEGACY_ACTOR),
        ),
        Target(module=FSDP_ENGINE, probe=probe_engine, apply=_apply_engine, shapes=(ENGINE_WITHOUT_REPLAY,)),
    ),
    why=(
        "MoE RL trains on routes the rollout never took: about 10% of Qwen3-30B-A3B's router decisions differ "
        "between the rollout engine and the trainer (94% of tokens differ in at least one layer), and the extreme "
        "probability ratios collapse training (arXiv 2510.11370). verl replays the rollout's routes (R3) or the "
        "old-log-prob pass's (R2) only on Megatron and VeOmni: on FSDP router_replay.mode is ignored, and VeOmni's "
        "replay does not cover qwen3_vl_moe."
    ),
    how=(
        "verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay: the Qwen3-VL-MoE and Qwen3.5-MoE routers take their "
        "top-k ids from the micro-batch's record (probabilities gathered at them and renormalised, so the gate keeps "
        "its gradient; MoE layer i reads slot i, also in checkpoint recompute); verl's actor (0.7) and FSDP engine (>= "
        "0.8) lay the record out as they lay out the tokens (remove-padding, Ulysses, dynamic batches), and R2 returns "
        "the recorded routes as routed_experts."
    ),
    upstream=("verl#5392", "verl#2996", "verl#4443"),
    remove_when="verl's FSDP engine honours `router_replay.mode` for `qwen3_vl_moe` and `qwen3_5_moe` (verl#4443 or a "
    "successor) in the oldest verl you run, and verl 0.7 is not among them.",
    details=DETAILS,
)
