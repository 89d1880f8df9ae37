"""The patch registry: what a patch is (``Patch`` and its ``Target``s), what its probe decided (``Verdict``), what it
did in this process (a ``Status`` per patch and target), and how a hook installs the patches it is given.

It imports nothing of the plugin's at module level, and only the standard library: the hook modules import this
before anything that can fail, so a broken environment still ends up as a recorded ``failed`` status and a WARNING,
never an exception in ``import verl``; and the patch modules, which import this, are never imported from here.
Specs are NamedTuples, not dataclasses: they are built at ``import verl``, where every millisecond counts.
"""

from __future__ import annotations

import ast
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from enum import Enum
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from verl_qwen3vl_plugin.compat import Source

logger = logging.getLogger("verl_qwen3vl_plugin")
# Same switch as verl's own modules: VERL_LOGGING_LEVEL=INFO shows the per-patch lines; a bad value is ignored here.
try:
    logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARNING").upper())
except ValueError:
    logger.setLevel(logging.WARNING)

DISABLE_ENV = "VERL_QWEN3VL_PLUGIN_DISABLE"
MODULES_ENV = "VERL_USE_EXTERNAL_MODULES"
MODEL, NPU = "model", "npu"
# The hook group -> the module verl imports for it. pyproject's entry points name the same modules (contract test).
HOOK_MODULES = {MODEL: "verl_qwen3vl_plugin.hooks.model_patch", NPU: "verl_qwen3vl_plugin.hooks.npu_patch"}
# The line that activates the plugin where the start-up hook cannot (``python -S``, or the hook switched off).
ACTIVATION_LINE = f"export {MODULES_ENV}={','.join(HOOK_MODULES.values())}"


class Verdict(str, Enum):
    """What a patch's probe concluded from the installed upstream code (the doctor prints this)."""

    APPLY = "apply"
    FIXED_UPSTREAM = "fixed_upstream"
    NOT_USED = "not_used"  # upstream no longer calls the code the patch replaces
    UNRECOGNIZED = "unrecognized"  # neither the known-affected nor a known-fixed shape: not patched
    DISABLED = "disabled"


class Status(str, Enum):
    """What a patch did to one target in this process."""

    PENDING = "pending"  # hook registered; the target module has not been imported yet
    APPLIED = "applied"
    SKIPPED = "skipped"  # verdict fixed_upstream or not_used
    UNRECOGNIZED = "unrecognized"
    DISABLED = "disabled"
    FAILED = "failed"


_OUTCOME = {
    Verdict.APPLY: Status.APPLIED,
    Verdict.FIXED_UPSTREAM: Status.SKIPPED,
    Verdict.NOT_USED: Status.SKIPPED,
    Verdict.UNRECOGNIZED: Status.UNRECOGNIZED,
    Verdict.DISABLED: Status.DISABLED,
}


class Decision(NamedTuple):
    verdict: Verdict
    reason: str


class Target(NamedTuple):
    """One upstream module a patch acts on (or, with ``name``, one thing in it), and what to do once it is imported."""

    module: str
    decide: Callable[[ast.Module], Decision]  # from the module's parsed source, without importing it
    # Called with the imported module when the verdict is APPLY; None: a target the plugin only reports on (its probe
    # never says APPLY).
    apply: Callable[[ModuleType], None] | None
    # The verdict where the module does not exist, from what upstream has instead; None: unrecognized.
    absent: Callable[[], Decision] | None = None
    name: str = ""  # what in the module is judged, where one patch has two targets in one module

    @property
    def label(self) -> str:
        return f"{self.module}:{self.name}" if self.name else self.module


def not_used_when_absent(reason: str) -> Callable[[], Decision]:
    """A target's ``absent`` for a module this stack may lack (an older release, a model family it does not ship):
    "not used", saying why, instead of failing closed."""
    return lambda: Decision(Verdict.NOT_USED, reason)


class Patch(NamedTuple):
    """One patch: everything the hooks, the doctor, the self-test and the docs need to know about it."""

    name: str
    group: str  # MODEL or NPU: the hook (and entry point) that installs it
    targets: tuple[Target, ...]
    devices: tuple[str, ...] | None  # the accelerators whose users it concerns ("npu"); None: every device
    why: str  # the failure users see
    how: str  # what is replaced
    upstream: tuple[str, ...]  # upstream PRs and issues
    remove_when: str
    selftest: str  # module whose run() checks the patch on tiny models (doctor --selftest)
    # Why the applied code does not run on a machine with these devices ({"cuda": bool, "npu": bool}), beyond
    # ``devices``; None: it runs wherever ``devices`` are present.
    dormant: Callable[[dict[str, bool]], str | None] | None = None


class PatchStatus(NamedTuple):
    patch: str
    target: str
    status: Status
    verdict: Verdict | None  # None while pending, or when it failed before deciding
    reason: str
    # For an applied patch: why this process never runs the code it installed; None: it does, or not applied.
    dormant: str | None = None


def dormant_reason(patch: Patch, devices: dict[str, bool]) -> str | None:
    """Why ``patch``, once applied, does not run on a machine with ``devices``; None: it runs there."""
    if patch.devices is not None and not any(devices.get(d) for d in patch.devices):
        return f"code for {'/'.join(patch.devices)} devices, and this machine has none"
    return patch.dormant(devices) if patch.dormant is not None else None


_statuses: dict[tuple[str, str], PatchStatus] = {}
_installed: dict[str, Patch] = {}


def record(
    patch: str, target: str, status: Status, reason: str, verdict: Verdict | None = None, concerns_here: bool = True
) -> PatchStatus:
    """Store a status and log it once per change: one line per patch and target in each process. An unrecognized
    target is a WARNING where the patch concerns this machine's devices, an INFO line elsewhere (the doctor shows
    it either way): verl imports its FSDP engine on every machine, and an Ascend-only verdict must not warn on GPUs."""
    new = PatchStatus(patch, target, status, verdict, reason)
    if _statuses.get((patch, target)) != new:
        _statuses[patch, target] = new
        if status is not Status.PENDING:  # the line comes when the target module is imported
            warn = status is Status.FAILED or (status is Status.UNRECOGNIZED and concerns_here)
            level = logging.WARNING if warn else logging.INFO
            logger.log(level, "verl-qwen3vl-plugin: %s on %s %s (%s)", patch, target, status.value, reason)
    return new


def patch_statuses() -> tuple[PatchStatus, ...]:
    """What each installed patch did to each of its targets in this process, in registry order; an applied one says
    whether this process runs it (asked now: verl's NPU patches can replace a class after the plugin patched it)."""
    if not any(s.status is Status.APPLIED for s in _statuses.values()):
        return tuple(_statuses.values())
    from verl_qwen3vl_plugin.compat import devices

    present = devices()
    return tuple(
        s._replace(dormant=dormant_reason(_installed[s.patch], present))
        if s.status is Status.APPLIED and s.patch in _installed
        else s
        for s in _statuses.values()
    )


def disabled_patches(names: tuple[str, ...], env: Mapping[str, str]) -> frozenset[str]:
    """The names of ``names`` listed in ``env``'s VERL_QWEN3VL_PLUGIN_DISABLE ("all": every one); unknown names warn."""
    listed = {name.strip() for name in env.get(DISABLE_ENV, "").split(",") if name.strip()}
    if "all" in listed:
        return frozenset(names)
    unknown = sorted(listed - set(names))
    if unknown:
        logger.warning(
            "verl-qwen3vl-plugin: %s names unknown patches %s; valid names: all, %s",
            DISABLE_ENV,
            unknown,
            ", ".join(names),
        )
    return frozenset(listed & set(names))


def decide(patch: Patch, target: Target, source: Source, disabled: frozenset[str]) -> Decision:
    """The one decision, for the hooks and the doctor alike: disabled by the user, else the target's probe on the
    target's parsed source. Fails closed: a source that is missing, unreadable or unparsable is ``unrecognized``,
    like a shape the probe does not know, unless the target knows what a missing module means."""
    if patch.name in disabled:
        return Decision(Verdict.DISABLED, f"listed in {DISABLE_ENV}")
    if source.tree is None:
        if source.missing and target.absent is not None:
            return target.absent()
        return Decision(Verdict.UNRECOGNIZED, f"{target.module} {source.problem}")
    return target.decide(source.tree)


def _on_target_imported(patch: Patch, target: Target, module: ModuleType) -> None:
    try:
        from verl_qwen3vl_plugin.compat import installed

        decision = decide(patch, target, installed(target.module), frozenset())  # disabled ones are not registered
        if decision.verdict is Verdict.APPLY:
            target.apply(module)
        concerns = decision.verdict is not Verdict.UNRECOGNIZED or _concerns_here(patch)
        record(patch.name, target.label, _OUTCOME[decision.verdict], decision.reason, decision.verdict, concerns)
    except Exception as exc:  # a plugin problem must never break the importer of the target module
        record(patch.name, target.label, Status.FAILED, f"{type(exc).__name__}: {exc}")


def _concerns_here(patch: Patch) -> bool:
    if patch.devices is None:
        return True
    from verl_qwen3vl_plugin.compat import devices

    return any(devices().get(d) for d in patch.devices)


def _register(patch: Patch, target: Target) -> None:
    try:
        import wrapt

        record(patch.name, target.label, Status.PENDING, f"waiting for {target.module} to be imported")
        wrapt.register_post_import_hook(lambda module: _on_target_imported(patch, target, module), target.module)
    except Exception as exc:
        record(patch.name, target.label, Status.FAILED, f"{type(exc).__name__}: {exc}")


def install_group(patches: Iterable[Patch], disabled: frozenset[str]) -> None:
    """Register ``patches`` (a hook's group), each once per process, except the ``disabled`` ones; never raises.

    Targets already imported are handled right away. This is what makes any mix of the start-up hook, the entry
    points and VERL_USE_EXTERNAL_MODULES patch exactly once.
    """
    for patch in patches:
        if patch.name in _installed:
            continue
        _installed[patch.name] = patch
        for target in patch.targets:
            if patch.name in disabled:
                record(patch.name, target.label, Status.DISABLED, f"listed in {DISABLE_ENV}", Verdict.DISABLED)
            else:
                _register(patch, target)
