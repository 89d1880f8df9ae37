"""The patch registry: what a patch is (``Patch`` and its ``Target``s), what its probe decided (``Verdict``), what it
did in this process (a ``Status`` per patch and target), and how a hook group installs its patches.

Only the standard library is imported at module level: the hook modules import this before anything that can fail,
so a broken environment still ends up as a recorded ``failed`` status and a WARNING, never an exception in
``import verl``. Specs are NamedTuples, not dataclasses: they are built at ``import verl``, where every millisecond
counts.
"""

from __future__ import annotations

import ast
import logging
import os
from collections.abc import Callable
from enum import Enum
from types import ModuleType
from typing import NamedTuple

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
    """One upstream module a patch acts on, and what to do once it is imported."""

    module: str
    decide: Callable[[ast.Module], Decision]  # from the module's parsed source, without importing it
    apply: Callable[[ModuleType], None]  # called with the imported module when the verdict is APPLY
    # The verdict where the module does not exist, from what upstream has instead; None: unrecognized.
    absent: Callable[[], Decision] | None = None


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


class PatchStatus(NamedTuple):
    patch: str
    target: str
    status: Status
    verdict: Verdict | None  # None while pending, or when it failed before deciding
    reason: str


_statuses: dict[tuple[str, str], PatchStatus] = {}
_installed: set[str] = set()


def record(patch: str, target: str, status: Status, reason: str, verdict: Verdict | None = None) -> PatchStatus:
    """Store a status and log it once per change: one line per patch and target in each process."""
    new = PatchStatus(patch, target, status, verdict, reason)
    if _statuses.get((patch, target)) != new:
        _statuses[patch, target] = new
        if status is not Status.PENDING:  # the line comes when the target module is imported
            level = logging.WARNING if status in (Status.FAILED, Status.UNRECOGNIZED) else logging.INFO
            logger.log(level, "verl-qwen3vl-plugin: %s on %s %s (%s)", patch, target, status.value, reason)
    return new


def patch_statuses() -> tuple[PatchStatus, ...]:
    """What each installed patch did to each of its targets in this process, in registry order."""
    return tuple(_statuses.values())


def disabled_patches(names: tuple[str, ...], env: dict[str, str] | None = None) -> frozenset[str]:
    """The names of ``names`` listed in VERL_QWEN3VL_PLUGIN_DISABLE ("all": every one); unknown names warn."""
    raw = (os.environ if env is None else env).get(DISABLE_ENV, "")
    listed = {name.strip() for name in raw.split(",") if name.strip()}
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


def decide(patch: Patch, target: Target, source: str | None) -> Decision:
    """The one decision, for the hooks and the doctor alike: disabled by the user, else the target's probe.

    Fails closed: unreadable or unparsable source is ``unrecognized``, like a shape the probe does not know.
    """
    from verl_qwen3vl_plugin import compat
    from verl_qwen3vl_plugin.patches import NAMES

    if patch.name in disabled_patches(NAMES):
        return Decision(Verdict.DISABLED, f"listed in {DISABLE_ENV}")
    if source is None:
        if target.absent is not None and compat.module_path(target.module) is None:
            return target.absent()
        return Decision(Verdict.UNRECOGNIZED, f"the source of {target.module} cannot be read")
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        return Decision(Verdict.UNRECOGNIZED, f"the source of {target.module} does not parse: {exc}")
    return target.decide(tree)


def _source(module: ModuleType) -> str | None:
    try:
        with open(module.__file__, encoding="utf-8") as f:
            return f.read()
    except (OSError, TypeError):
        return None


def _on_target_imported(patch: Patch, target: Target, module: ModuleType) -> None:
    try:
        decision = decide(patch, target, _source(module))
        if decision.verdict is Verdict.APPLY:
            target.apply(module)
        record(patch.name, target.module, _OUTCOME[decision.verdict], decision.reason, decision.verdict)
    except Exception as exc:  # a plugin problem must never break the importer of the target module
        record(patch.name, target.module, Status.FAILED, f"{type(exc).__name__}: {exc}")


def _register(patch: Patch, target: Target) -> None:
    try:
        import wrapt

        record(patch.name, target.module, Status.PENDING, f"waiting for {target.module} to be imported")
        wrapt.register_post_import_hook(lambda module: _on_target_imported(patch, target, module), target.module)
    except Exception as exc:
        record(patch.name, target.module, Status.FAILED, f"{type(exc).__name__}: {exc}")


def install_group(group: str) -> None:
    """What a hook module does: register every patch of ``group``, once per process, and never raise.

    Targets already imported are handled right away. This is what makes any mix of the start-up hook, the entry
    points and VERL_USE_EXTERNAL_MODULES patch exactly once.
    """
    try:
        from verl_qwen3vl_plugin.patches import NAMES, PATCHES

        disabled = disabled_patches(NAMES)
        for patch in PATCHES:
            if patch.group != group or patch.name in _installed:
                continue
            _installed.add(patch.name)
            for target in patch.targets:
                if patch.name in disabled:
                    record(patch.name, target.module, Status.DISABLED, f"listed in {DISABLE_ENV}", Verdict.DISABLED)
                else:
                    _register(patch, target)
    except Exception as exc:
        record(HOOK_MODULES[group], "*", Status.FAILED, f"{type(exc).__name__}: {exc}")
