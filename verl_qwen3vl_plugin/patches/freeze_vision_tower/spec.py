"""Targets of ``freeze_vision_tower``: verl's actor config, where the setting is handed to the FSDP engine's
config; verl's FSDP engine, which freezes the tower before wrapping it; and verl 0.7's legacy FSDP workers, which
freeze it themselves (reported, not patched).

- ``CONFIG_DECLARES_SETTING``: ``ActorConfig`` declares the field ``freeze_vision_tower`` and defines
  ``__post_init__``; ``FSDPActorConfig`` declares ``fsdp_config`` and its ``__post_init__`` calls
  ``super().__post_init__()`` and assigns ``self.engine = self.fsdp_config`` (the object the engine receives).
- ``ENGINE_IGNORES_SETTING``: no line of the engine's module names ``freeze_vision_tower``; the module imports
  ``get_fsdp_wrap_policy`` by name; ``FSDPEngine._build_fsdp_module(self, module)`` calls it with ``module=module``;
  ``FSDPEngine._build_model_optimizer`` calls ``_build_lora_module``, then ``_build_fsdp_module``, then
  ``_build_optimizer``; ``_build_optimizer`` takes the wrapped module's ``parameters()``.
- ``WORKERS_FREEZE_TOWER``: ``ActorRolloutRefWorker._build_model_optimizer`` has an ``if`` on
  ``self.config.actor``'s ``freeze_vision_tower`` whose body calls ``requires_grad_(False)`` on what
  ``get_vl_model_vision_tower`` returned and sets ``use_orig_params = True``, and that function returns ``.visual``
  of the model or of its ``.model``.
"""

from __future__ import annotations

import ast
from types import ModuleType

from verl_qwen3vl_plugin import originals, syntax
from verl_qwen3vl_plugin.families import FAMILIES
from verl_qwen3vl_plugin.registry import MODEL, Decision, Patch, Shape, Target, Verdict, unrecognized
from verl_qwen3vl_plugin.upstream import FSDP_ENGINE, FSDP_WORKERS

ACTOR_CONFIG = "verl.workers.config.actor"
SETTING = "freeze_vision_tower"
WRAP_POLICY = "get_fsdp_wrap_policy"
FINDER = "get_vl_model_vision_tower"
TOWERS = frozenset(family.vision_class for family in FAMILIES)

CONFIG_DECLARES_SETTING = Shape(id="verl0.7-actor-config-declares-setting", verdict=Verdict.APPLY, verl=">=0.7")
ENGINE_IGNORES_SETTING = Shape(id="verl0.7-fsdp-engine-ignores-setting", verdict=Verdict.APPLY, verl=">=0.7")
WORKERS_FREEZE_TOWER = Shape(id="verl0.7-workers-freeze-visual", verdict=Verdict.FIXED_UPSTREAM, verl="<0.8")
NO_LEGACY_WORKERS = Shape(id="verl0.8-no-legacy-workers", verdict=Verdict.NOT_USED, verl=">=0.8")


def _fields(cls: ast.ClassDef) -> set[str]:
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _assigns(func: ast.FunctionDef, target: str, value: str) -> bool:
    """Whether ``func`` has the statement ``<target> = <value>`` (as source text)."""
    return any(
        isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets] == [target] and ast.unparse(n.value) == value
        for n in ast.walk(func)
    )


def probe_config(tree: ast.Module) -> Decision:
    base, fsdp = syntax.find_class(tree, "ActorConfig"), syntax.find_class(tree, "FSDPActorConfig")
    if base is None or SETTING not in _fields(base) or syntax.find_function(base, "__post_init__") is None:
        return unrecognized(f"ActorConfig declares no {SETTING} field, or has no __post_init__")
    post_init = syntax.find_function(fsdp, "__post_init__")
    if (
        "fsdp_config" not in _fields(fsdp)
        or post_init is None
        or "super().__post_init__()" not in [ast.unparse(c) for c in syntax.call_nodes(post_init, "__post_init__")]
        or not _assigns(post_init, "self.engine", "self.fsdp_config")
    ):
        return unrecognized("FSDPActorConfig does not hand its fsdp_config to the engine as verl 0.7 does")
    return CONFIG_DECLARES_SETTING.decision(
        f"the actor config declares {SETTING}; the plugin hands it to the FSDP engine config"
    )


def _order(func: ast.FunctionDef, methods: tuple[str, ...]) -> bool:
    """Whether ``func`` calls each ``self.<method>`` once, in this order."""
    calls = [[c for c in syntax.call_nodes(func, m) if syntax.calls_self(c, m)] for m in methods]
    if any(len(found) != 1 for found in calls):
        return False
    lines = [(found[0].lineno, found[0].col_offset) for found in calls]
    return lines == sorted(lines)


def probe_engine(tree: ast.Module) -> Decision:
    if syntax.mentions(tree, SETTING):
        return unrecognized(f"verl's FSDP engine names {SETTING}: it may honour it itself now")
    engine = syntax.find_class(tree, "FSDPEngine")
    build, wrap = (syntax.find_function(engine, m) for m in ("_build_model_optimizer", "_build_fsdp_module"))
    optimizer = syntax.find_function(engine, "_build_optimizer")
    imported = any(
        isinstance(n, ast.ImportFrom) and any(a.name == WRAP_POLICY and not a.asname for a in n.names)
        for n in tree.body
    )
    if build is None or wrap is None or optimizer is None or not imported:
        return unrecognized(f"no FSDPEngine._build_model_optimizer / _build_fsdp_module / {WRAP_POLICY} import")
    policy_calls = syntax.call_nodes(wrap, WRAP_POLICY)
    if syntax.parameters(wrap) != ["self", "module"] or not any(
        any(k.arg == "module" and ast.unparse(k.value) == "module" for k in c.keywords) for c in policy_calls
    ):
        return unrecognized(f"_build_fsdp_module(self, module) does not ask {WRAP_POLICY}(module=module)")
    if not _order(build, ("_build_lora_module", "_build_fsdp_module", "_build_optimizer")):
        return unrecognized("_build_model_optimizer does not add LoRA, wrap, then build the optimizer, once each")
    if not syntax.calls(optimizer, "parameters"):
        return unrecognized("_build_optimizer does not take the wrapped module's parameters()")
    return ENGINE_IGNORES_SETTING.decision(
        f"verl's FSDP engine never reads actor.{SETTING}: the plugin freezes the tower before wrapping"
    )


def _freezes_tower(func: ast.FunctionDef) -> bool:
    for node in ast.walk(func):
        if not (isinstance(node, ast.If) and syntax.has_string(node.test, SETTING)):
            continue
        body = ast.Module(body=node.body, type_ignores=[])
        found = [
            t.id
            for n in ast.walk(body)
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and syntax.calls(n.value, FINDER)
            for t in n.targets
            if isinstance(t, ast.Name)
        ]
        frozen = [
            c
            for c in syntax.call_nodes(body, "requires_grad_")
            if isinstance(c.func, ast.Attribute)
            and ast.unparse(c.func.value) in found
            and [ast.unparse(a) for a in c.args] == ["False"]
        ]
        if "self.config.actor" in ast.unparse(node.test) and frozen and _assigns(body, "self.use_orig_params", "True"):
            return True
    return False


def probe_workers(tree: ast.Module) -> Decision:
    worker = syntax.find_class(tree, "ActorRolloutRefWorker")
    build = syntax.find_function(worker, "_build_model_optimizer")
    finder = syntax.find_function(tree, FINDER)
    returns = {ast.unparse(n.value) for n in ast.walk(finder) if isinstance(n, ast.Return)} if finder else set()
    param = syntax.parameters(finder)[0] if finder and syntax.parameters(finder) else ""
    known = {f"{param}.model.visual", f"{param}.visual", "None"}
    if build is None or not returns or not returns <= known or not _freezes_tower(build):
        return unrecognized(f"verl's FSDP workers do not freeze model.visual on actor.{SETTING} as verl 0.7 does")
    return WORKERS_FREEZE_TOWER.decision(
        f"verl's FSDP workers honour actor.{SETTING}: they freeze model.visual (every part of the Qwen3-VL / "
        "Qwen3.5 tower) and use FSDP's original parameters"
    )


def _apply_config(module: ModuleType, decision: Decision) -> None:
    from verl_qwen3vl_plugin.patches.freeze_vision_tower.replacement import carry_request

    originals.wrap(module.ActorConfig, "__post_init__", carry_request)


def _apply_engine(module: ModuleType, decision: Decision) -> None:
    from verl_qwen3vl_plugin.patches.freeze_vision_tower.replacement import freeze_before_wrapping, tower_unit

    originals.wrap(module.FSDPEngine, "_build_fsdp_module", lambda build: freeze_before_wrapping(build, TOWERS))
    originals.wrap(module, WRAP_POLICY, tower_unit)


DETAILS = """\
**Seen.** verl 0.7.0 and 0.7.1 honour the setting on their legacy FSDP workers (the default there): they freeze
`model.visual` after LoRA and force FSDP1's `use_orig_params`. Their FSDP engine (`use_legacy_worker_impl=disable`),
the only FSDP path of verl 0.8 and 0.9, never reads it: `grep -rn freeze_vision_tower` finds only the config field.
`tests/patches/freeze_vision_tower/test_freeze.py` runs verl's real `FSDPEngine` (its `_build_model_optimizer`,
`forward_backward_batch` and `optimizer_step`) on two FSDP2 gloo ranks holding different images: with the setting on
every vision parameter is bitwise unchanged after two AdamW steps and holds no optimizer state, the language model
changes, and the tower's output carries no autograd graph. With the setting off, and with the setting on but the
patch disabled, the tower changes.

**Details of the change.** `ActorConfig.__post_init__` sets a private attribute on the actor's `fsdp_config`, the
object verl hands its engine as `engine_config` (the engine sees no actor setting otherwise). The engine's
`_build_fsdp_module` then freezes each Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 or Qwen3.5-MoE vision tower in the module
(patch embedding, position table, blocks, merger, deepstack mergers: everything under the tower), after LoRA and
before wrapping, so verl's optimizer, built from the wrapped parameters, keeps no state for it. Under FSDP1 the
wrap policy gives the frozen tower a unit of its own: no flat parameter mixes frozen and trainable ones, which FSDP1
refuses without `use_orig_params`. A WARNING says where the setting is not honoured: another strategy (Megatron,
VeOmni, TorchTitan, FSDP-Turbo: their own code never reads it either), or a model with none of these towers. The
reference model (`forward_only`) is left alone.

**LoRA.** The tower is frozen after verl adds the adapters, as verl 0.7's workers do: adapters that
`target_modules` put in the tower (`all-linear` does) are frozen too and stay at their initial, zero-effect values.
A WARNING counts them: leave the tower out of `target_modules` (or list it in `exclude_modules`) to save their cost.

**Rollout weights.** Frozen parameters stay in the module and its state dict: every weight sync sends the tower as
before. After the first sync the tower's weights never change, so later syncs could skip them; verl's sync has no
such filter, and a rollout that frees its weights while asleep needs them resent. For Qwen3-VL-30B-A3B's tower that
is 1.00 GiB of bf16 per sync (`benchmarks/freeze_vision_tower.py`, computed from its config).

**Upstream plan.** In `verl/workers/engine/fsdp/transformer_impl.py`, freeze the tower in `_build_model_optimizer`
after `_build_lora_module` when the actor config asks (pass `freeze_vision_tower` to the engine config), with the
FSDP1 wrap policy above; verl#6320 (`freeze_module_pattern`) generalises it. PR title: `[fsdp] fix: honour
actor.freeze_vision_tower in the FSDP engine`.
"""

PATCH = Patch(
    name="freeze_vision_tower",
    title="actor.freeze_vision_tower honoured by verl's FSDP engine",
    group=MODEL,
    targets=(
        Target(module=ACTOR_CONFIG, probe=probe_config, apply=_apply_config, shapes=(CONFIG_DECLARES_SETTING,)),
        Target(module=FSDP_ENGINE, probe=probe_engine, apply=_apply_engine, shapes=(ENGINE_IGNORES_SETTING,)),
        Target(
            module=FSDP_WORKERS,
            probe=probe_workers,
            apply=None,
            absent=NO_LEGACY_WORKERS.when_absent("no legacy FSDP workers: the FSDP engine is verl's only FSDP path"),
            shapes=(WORKERS_FREEZE_TOWER, NO_LEGACY_WORKERS),
        ),
    ),
    why=(
        "verl's actor config declares freeze_vision_tower, but its FSDP engine (verl 0.8 and 0.9's only FSDP path) "
        "never reads it: a user who sets it trains the vision tower anyway, pays for its backward pass and its "
        "optimizer state, and is never told."
    ),
    how=(
        "ActorConfig.__post_init__ hands the setting to the FSDP engine config; FSDPEngine._build_fsdp_module "
        "freezes the Qwen3-VL / Qwen3.5 vision tower (requires_grad_(False)) after LoRA and before wrapping, and "
        "FSDP1's wrap policy gives the frozen tower its own unit."
    ),
    upstream=("verl#596", "verl#1346", "verl#2526", "verl#6104", "verl#6320"),
    remove_when="verl's FSDP engine freezes the vision tower on actor.freeze_vision_tower in the oldest verl you run.",
    details=DETAILS,
)
