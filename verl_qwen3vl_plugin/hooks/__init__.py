"""The modules verl's plugin loading imports: entry points (verl >= 0.9), ``VERL_USE_EXTERNAL_MODULES``, or the
plugin's start-up hook. Each installs the patches of its group (``registry.HOOK_MODULES``) and never raises."""

from __future__ import annotations

import os

from verl_qwen3vl_plugin.registry import HOOK_MODULES, Status, disabled_patches, install_group, record


def install(group: str) -> None:
    """What a hook module does: install the patches of ``group``, minus those the user disabled; never raises."""
    try:
        from verl_qwen3vl_plugin.patches import NAMES, PATCHES

        install_group((p for p in PATCHES if p.group == group), disabled_patches(NAMES, os.environ))
    except Exception as exc:
        record(HOOK_MODULES[group], "*", Status.FAILED, f"{type(exc).__name__}: {exc}")
