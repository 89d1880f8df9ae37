"""Patch statuses: what each patch did in this process, and which patches the user disabled.

Only the standard library is imported here: the hook modules import this before anything that can fail, so a
broken environment still ends up as a recorded, logged ``FAILED`` status instead of an exception in ``import verl``.
"""

from __future__ import annotations

import importlib
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
POS_EMBED = "qwen3_vl_pos_embed"
NPU_MOE_ROUTING = "npu_qwen3_vl_moe_routing"
PATCH_NAMES = (POS_EMBED, NPU_MOE_ROUTING)


class Status(str, Enum):
    PENDING = "pending"  # hook loaded; the module it patches has not been imported in this process yet
    APPLIED = "applied"
    FIXED_UPSTREAM = "skipped: fixed upstream"
    NOT_USED = "skipped: not used by this transformers"
    DISABLED = "disabled"
    FAILED = "failed"


class PatchStatus(NamedTuple):  # a NamedTuple, not a dataclass: 0.1 ms instead of 0.7 ms at `import verl`
    name: str
    status: Status
    reason: str


_statuses: dict[str, PatchStatus] = {}
_started: set[str] = set()


def record(name: str, status: Status, reason: str) -> PatchStatus:
    """Store a patch's status and log it once per change, so each process says what it did in one line."""
    new = PatchStatus(name, status, reason)
    if _statuses.get(name) != new:
        _statuses[name] = new
        if status is Status.PENDING:  # not resolved yet: the line comes when the target module is imported
            return new
        level = logging.WARNING if status is Status.FAILED else logging.INFO
        logger.log(level, "verl-qwen3vl-plugin: %s %s (%s)", name, status.value, reason)
    return new


def record_failure(name: str, exc: BaseException) -> PatchStatus:
    return record(name, Status.FAILED, f"{type(exc).__name__}: {exc}")


def patch_statuses() -> dict[str, PatchStatus]:
    """Statuses of the patches whose hooks were loaded in this process, by patch name."""
    return dict(_statuses)


def disabled_patches(env: dict[str, str] | None = None) -> frozenset[str]:
    """Patch names listed in VERL_QWEN3VL_PLUGIN_DISABLE ("all" disables every patch); unknown names warn."""
    raw = (os.environ if env is None else env).get(DISABLE_ENV, "")
    names = {name.strip() for name in raw.split(",") if name.strip()}
    if "all" in names:
        return frozenset(PATCH_NAMES)
    unknown = sorted(names - set(PATCH_NAMES))
    if unknown:
        logger.warning(
            "verl-qwen3vl-plugin: %s names unknown patches %s; valid names: all, %s",
            DISABLE_ENV,
            unknown,
            ", ".join(PATCH_NAMES),
        )
    return frozenset(names & set(PATCH_NAMES))


def guarded(name: str, func: Callable[..., object], *args: object) -> None:
    """Run a hook step; any exception becomes a FAILED status and a WARNING, never an error in the importer."""
    try:
        func(*args)
    except Exception as exc:  # a plugin problem must never break `import verl` or a model import
        record_failure(name, exc)


def disabled_verdict(name: str) -> tuple[Status, str] | None:
    """The DISABLED verdict when the user disabled ``name``, else None."""
    if name in disabled_patches():
        return Status.DISABLED, f"listed in {DISABLE_ENV}"
    return None


def start_install(name: str, pending_reason: str) -> bool:
    """Whether a patch should register its hooks now: the first call in this process, and not disabled.

    This is what makes loading the hooks twice (entry point and VERL_USE_EXTERNAL_MODULES together) patch once.
    """
    if name in _started:
        return False
    _started.add(name)
    verdict = disabled_verdict(name)
    if verdict is not None:
        record(name, *verdict)
        return False
    record(name, Status.PENDING, pending_reason)
    return True


def on_import(name: str, module: str, callback: Callable[[ModuleType], None]) -> None:
    """Run ``callback(module)`` once ``module`` is imported (now, if it already is), guarded like every hook step."""
    import wrapt

    wrapt.register_post_import_hook(lambda mod: guarded(name, callback, mod), module)


def install_patch(name: str, module: str) -> None:
    """Import a patch module and call its ``install()``, guarded: what the thin hook modules do."""
    guarded(name, lambda: importlib.import_module(module).install())
