"""The modules verl's plugin loading imports: entry points (verl >= 0.9), ``VERL_USE_EXTERNAL_MODULES``, or the
plugin's start-up hook. Each watches the targets of its group (``registry.HOOK_MODULES``) and never raises."""

from __future__ import annotations

import os
from functools import partial

from verl_qwen3vl_plugin.registry import DISABLE_ENV, HOOK_MODULES, Status, disable_list, logger, record, watch


def watch_group(group: str) -> None:
    """What a hook module does: watch the targets of ``group``'s patches, minus those the user disabled, from the
    generated target index (no patch module is imported until a target is); never raises."""
    try:
        from verl_qwen3vl_plugin.patches import NAMES, spec
        from verl_qwen3vl_plugin.patches.targets import TARGETS

        disabled, unknown = disable_list(NAMES, os.environ)
        if unknown:
            logger.warning(
                "verl-qwen3vl-plugin: %s names unknown patches %s; valid names: all, %s",
                DISABLE_ENV,
                unknown,
                ", ".join(NAMES),
            )
        for name, patch_group, module, label in TARGETS:
            if patch_group == group:
                watch(name, module, label, partial(spec, name), disabled)
    except Exception as exc:
        record(HOOK_MODULES[group], "*", Status.FAILED, f"{type(exc).__name__}: {exc}")
