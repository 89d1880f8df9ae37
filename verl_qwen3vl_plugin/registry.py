"""The patch registry: what a patch is (``Patch`` and its ``Target``s), what its probe decided (a ``Decision``: a
verdict and the stable id of the upstream shape it recognised), what it did in this process (a ``Status`` per patch
and target), and how a hook watches the patches it is given.

It imports only the standard library: the hook modules import this before anything that can fail, so a broken
environment still ends up as a recorded ``failed`` status and a WARNING, never an exception in ``import verl``. At
``import verl`` the hooks read the generated target index (``patches/targets.py``) and import no patch module: a
patch's spec is imported when one of its targets is.
"""

from __future__ import annotations

import ast
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from enum import Enum
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from verl_qwen3vl_plugin.environment import Source

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


def activation_line(env: Mapping[str, str] | None = None) -> str:
    """The line that activates the plugin where the start-up hook cannot (``python -S``, or the hook switched off),
    keeping the modules ``env`` already lists."""
    listed = [m for m in (env or {}).get(MODULES_ENV, "").split(",") if m]
    return f"export {MODULES_ENV}={','.join(listed + [m for m in HOOK_MODULES.values() if m not in listed])}"


ACTIVATION_LINE = activation_line()


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


def _clauses(*specs: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(operator, release, text) of each comma-separated clause of ``specs``, such as ``>=0.7.1,<0.9``."""
    found = []
    for clause in (c.strip() for spec in specs for c in spec.split(",") if c.strip()):
        op = next((o for o in (">=", "<", "==") if clause.startswith(o)), None)
        if op is None:
            raise ValueError(f"release range clause {clause!r}: use >=, < or ==")
        found.append((op, tuple(int(part) for part in clause[len(op) :].strip().split(".")), clause))
    return found


def in_range(version: tuple[int, ...], spec: str) -> bool:
    """Whether release ``version`` is in ``spec`` (operators ``>=``, ``<``, ``==``; "" is every release). The standard
    library only: the registry is imported at ``import verl``."""
    held = {">=": lambda bound: version >= bound, "<": lambda bound: version < bound}
    held["=="] = lambda bound: version[: len(bound)] == bound
    return all(held[op](bound) for op, bound, _ in _clauses(spec))


@dataclass(frozen=True, kw_only=True)
class Shape:
    """One upstream shape a probe knows: its stable id, the verdict it leads to, and where it is seen. A target's
    ``shapes`` are the one record of what each release holds: the expected verdicts, the compatibility matrix and the
    docs derive from them, and the tests check that the probe reads each CI stack as declared."""

    id: str
    verdict: Verdict
    verl: str = ""  # the verl releases that hold it, as a range (``in_range``); "": every release
    transformers: str = ""  # likewise, the transformers releases
    # Where its code is read when no release holds it (a pull request's branch): then no stack matches it.
    elsewhere: str = ""

    def seen_on(self, verl: tuple[int, ...], transformers: tuple[int, ...]) -> bool:
        return not self.elsewhere and in_range(verl, self.verl) and in_range(transformers, self.transformers)

    def decision(self, reason: str) -> Decision:
        """What a probe returns on recognising this shape; ``reason`` says what it saw, for people."""
        return Decision(self.verdict, self.id, reason)

    def when_absent(self, reason: str) -> Callable[[], Decision]:
        """A target's ``absent``, for a module this stack may lack (an older release, a model family it does not
        ship): this "not used" shape, saying why, instead of failing closed."""
        if self.verdict is not Verdict.NOT_USED:
            raise ValueError(f"an absent module is not used, not {self.verdict.value}: {self.id}")
        return lambda: self.decision(reason)

    def narrowed(self, verl: str = "", transformers: str = "") -> Shape:
        """The same shape, seen on fewer releases: where one target's module exists on fewer releases than
        another's (Qwen3.5's, from transformers 5.2)."""
        return replace(self, verl=_joined(self.verl, verl), transformers=_joined(self.transformers, transformers))


def _joined(*specs: str) -> str:
    """The release ranges ``specs`` all hold, written as one: the highest ``>=``, the lowest ``<``, any ``==``."""
    clauses = _clauses(*specs)
    low = max((c for c in clauses if c[0] == ">="), key=lambda c: c[1], default=None)
    high = min((c for c in clauses if c[0] == "<"), key=lambda c: c[1], default=None)
    return ",".join([c[2] for c in (low, high) if c] + [c[2] for c in clauses if c[0] == "=="])


@dataclass(frozen=True)
class Decision:
    """A probe's conclusion. ``shape`` is a stable id of what it recognised (``verl0.7.0-top-k-experts``;
    ``unrecognized()`` gives every unknown shape the one id ``UNKNOWN``): appliers and tests branch on it, never on
    ``reason``, which is for people."""

    verdict: Verdict
    shape: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class Target:
    """One upstream module a patch acts on (or, with ``name``, one thing in it), and what to do once it is imported."""

    module: str
    probe: Callable[[ast.Module], Decision]  # reads the module's parsed source, without importing it
    # Called with the imported module and the decision when the verdict is APPLY; None: a target the plugin only
    # reports on (its probe never says APPLY).
    apply: Callable[[ModuleType, Decision], None] | None
    # The decision where the module does not exist, from what upstream has instead; None: unrecognized.
    absent: Callable[[], Decision] | None = None
    name: str = ""  # what in the module is probed, where one patch has two targets in one module
    reads: tuple[str, ...] = ()  # the other modules its probe reads (a contract test holds every probe to this)
    shapes: tuple[Shape, ...] = ()  # every shape its probe knows, and where each is seen

    def shape_on(self, verl: tuple[int, ...], transformers: tuple[int, ...]) -> Shape:
        """The one declared shape seen on these releases; ``LookupError`` where none or several are."""
        found = [s for s in self.shapes if s.seen_on(verl, transformers)]
        if len(found) != 1:
            where = f"verl {'.'.join(map(str, verl))}, transformers {'.'.join(map(str, transformers))}"
            ids = [s.id for s in found] or "none"
            raise LookupError(f"{self.label}: {len(found)} declared shapes seen on {where} ({ids}); declare one")
        return found[0]

    @property
    def label(self) -> str:
        return f"{self.module}:{self.name}" if self.name else self.module


PATCHES_PACKAGE = "verl_qwen3vl_plugin.patches"
UNKNOWN = "unrecognized"  # the shape of every decision whose upstream code no probe recognises


def unrecognized(reason: str) -> Decision:
    """A probe's "I do not know this shape": no shape id to branch on, only what it looked for, for people."""
    return Decision(Verdict.UNRECOGNIZED, UNKNOWN, reason)


@dataclass(frozen=True, kw_only=True)
class Patch:
    """One patch: everything the hooks, the doctor, the self-test and the docs need to know about it."""

    name: str
    title: str  # what it does, in a line (the docs' heading)
    group: str  # MODEL or NPU: the hook (and entry point) that installs it
    targets: tuple[Target, ...]
    devices: tuple[str, ...] | None = None  # the accelerators whose users it concerns ("npu"); None: every device
    why: str  # the failure users see
    how: str  # what is replaced
    upstream: tuple[str, ...]  # upstream PRs and issues
    remove_when: str
    details: str = ""  # the longer story, in Markdown: what the short fields leave out (docs/patches.md prints it)
    # The module whose run() checks the patch on tiny models (doctor --selftest); "": the patch's own ``selftest``.
    selftest: str = ""
    # Why the applied code does not run on a machine with these devices ({"cuda": bool, "npu": bool}), beyond
    # ``devices``; None: it runs wherever ``devices`` are present.
    dormant: Callable[[dict[str, bool]], str | None] | None = None

    def __post_init__(self) -> None:
        if not self.selftest:
            object.__setattr__(self, "selftest", f"{PATCHES_PACKAGE}.{self.name}.selftest")

    def target(self, label: str) -> Target:
        found = next((t for t in self.targets if t.label == label), None)
        if found is None:
            raise KeyError(f"patch {self.name} has no target {label!r}")
        return found


@dataclass(frozen=True)
class PatchStatus:
    patch: str
    target: str
    status: Status
    verdict: Verdict | None  # None while pending, or when it failed before deciding
    reason: str
    # For an applied patch: why this process never runs the code it installed; None: it does, or not applied.
    dormant: str | None = None


def concerns(patch: Patch, devices: Mapping[str, bool]) -> bool:
    """Whether ``patch`` is for a machine with ``devices``: an unrecognized target warns (and the doctor asks for
    action) only there. verl imports its FSDP engine on every machine; an Ascend-only verdict must not warn on GPUs."""
    return patch.devices is None or any(devices.get(d) for d in patch.devices)


def dormant_reason(patch: Patch, devices: dict[str, bool]) -> str | None:
    """Why ``patch``, once applied, does not run on a machine with ``devices``; None: it runs there."""
    if not concerns(patch, devices):
        return f"code for {'/'.join(patch.devices)} devices, and this machine has none"
    return patch.dormant(devices) if patch.dormant is not None else None


_statuses: dict[tuple[str, str], PatchStatus] = {}
_loaded: dict[str, Patch] = {}  # the specs loaded in this process, by name
_watched: set[tuple[str, str]] = set()  # (patch, target label): each registered once per process


def record(
    patch: str, target: str, status: Status, reason: str, verdict: Verdict | None = None, concerns_here: bool = True
) -> PatchStatus:
    """Store a status and log it once per change: one line per patch and target in each process. An unrecognized
    target is a WARNING where the patch concerns this machine (``concerns``), an INFO line elsewhere (the doctor shows
    it either way)."""
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
    from verl_qwen3vl_plugin.environment import devices

    present = devices()
    return tuple(
        replace(s, dormant=dormant_reason(_loaded[s.patch], present))
        if s.status is Status.APPLIED and s.patch in _loaded
        else s
        for s in _statuses.values()
    )


def disable_list(names: Iterable[str], env: Mapping[str, str]) -> tuple[frozenset[str], list[str]]:
    """The patches of ``names`` that ``env``'s VERL_QWEN3VL_PLUGIN_DISABLE switches off ("all": every one), and the
    unknown names it lists, sorted: the hooks warn about those, the doctor refuses them."""
    names = tuple(names)
    listed = {name.strip() for name in env.get(DISABLE_ENV, "").split(",") if name.strip()}
    unknown = sorted(listed - {"all", *names})
    return frozenset(names if "all" in listed else listed & set(names)), unknown


def disabled_by_user(name: str, disabled: frozenset[str]) -> Decision | None:
    """The one check of the user's switch (``disable_list``): the hooks ask it before loading a spec, the doctor
    through ``decide``."""
    return Decision(Verdict.DISABLED, "disabled", f"listed in {DISABLE_ENV}") if name in disabled else None


def decide(patch: Patch, target: Target, source: Source, disabled: frozenset[str]) -> Decision:
    """The one decision, for the hooks and the doctor alike: disabled by the user, else the target's probe on the
    target's parsed source. Fails closed: a source that is missing, unreadable or unparsable is ``unrecognized``,
    like a shape the probe does not know, unless the target knows what a missing module means."""
    off = disabled_by_user(patch.name, disabled)
    if off is not None:
        return off
    if source.tree is None:
        if source.missing and target.absent is not None:
            return target.absent()
        return unrecognized(f"{target.module} {source.problem}")
    return target.probe(source.tree)


def decide_installed(patch: Patch, target: Target, disabled: frozenset[str] = frozenset()) -> Decision:
    """``decide`` on the target's installed source: what the hooks, the doctor and the self-tests ask."""
    from verl_qwen3vl_plugin.environment import source_of  # the registry itself needs only the standard library

    return decide(patch, target, source_of(target.module), disabled)


def _on_target_imported(name: str, label: str, load: Callable[[], Patch], module: ModuleType) -> None:
    try:
        from verl_qwen3vl_plugin.environment import devices

        patch = _loaded.setdefault(name, load())
        target = patch.target(label)
        decision = decide_installed(patch, target)  # disabled ones are not registered
        if decision.verdict is Verdict.APPLY:
            target.apply(module, decision)
        here = decision.verdict is not Verdict.UNRECOGNIZED or concerns(patch, devices())
        record(name, label, _OUTCOME[decision.verdict], decision.reason, decision.verdict, here)
    except Exception as exc:  # a plugin problem must never break the importer of the target module
        record(name, label, Status.FAILED, f"{type(exc).__name__}: {exc}")


def watch(name: str, module: str, label: str, load: Callable[[], Patch], disabled: frozenset[str]) -> None:
    """Decide and apply patch ``name``'s target ``label`` once ``module`` is imported (now, if it is); never raises.
    ``load`` gives the spec then: at ``import verl`` nothing but names is needed."""
    if (name, label) in _watched:
        return
    _watched.add((name, label))
    off = disabled_by_user(name, disabled)
    if off is not None:
        record(name, label, _OUTCOME[off.verdict], off.reason, off.verdict)
        return
    try:
        from verl_qwen3vl_plugin.import_watch import after_import

        record(name, label, Status.PENDING, f"waiting for {module} to be imported")
        after_import(module, lambda imported: _on_target_imported(name, label, load, imported))
    except Exception as exc:
        record(name, label, Status.FAILED, f"{type(exc).__name__}: {exc}")


def watch_patches(patches: Iterable[Patch], disabled: frozenset[str]) -> None:
    """Register ``patches`` whose specs are at hand (the hooks go through ``watch`` with the target index instead),
    each target once per process, except the ``disabled`` ones; never raises. Targets already imported are handled
    right away: any mix of the start-up hook, the entry points and VERL_USE_EXTERNAL_MODULES patches exactly once."""
    for patch in patches:
        for target in patch.targets:
            watch(patch.name, target.module, target.label, lambda patch=patch: patch, disabled)
