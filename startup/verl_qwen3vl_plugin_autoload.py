"""Start-up hook of verl-qwen3vl-plugin: loads the plugin's hooks right after ``import verl``, on every verl.

Why: verl 0.7.x and 0.8.0 load plugins only from ``VERL_USE_EXTERNAL_MODULES``, so a plain ``pip install`` would
leave them unpatched. ``site`` imports this module from ``verl_qwen3vl_plugin_autoload.pth`` in every Python process
of the environment (Ray workers included), before any user code.

How: a thin shim. It asks the package's import watcher (``verl_qwen3vl_plugin.import_watch``, standard library only)
to call ``verl_qwen3vl_plugin.activation`` once verl's ``__init__`` has run; activation leaves verl >= 0.9 to its own
entry-point discovery. Until verl is imported nothing else of the plugin is imported, and nothing here may raise: a
broken plugin must not break ``python``.

Off: ``VERL_QWEN3VL_PLUGIN_AUTOLOAD=0`` (read at start-up, and again when verl is imported). ``python -S`` skips
``.pth`` files; there, ``VERL_USE_EXTERNAL_MODULES`` still works.
"""

import os
import sys

ENV = "VERL_QWEN3VL_PLUGIN_AUTOLOAD"
# What this hook did in this process: "off", "waiting for verl", or what activation returned once verl was imported.
state = "off"


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _warn(what: str, exc: Exception) -> str:
    import logging

    message = f"{what}: {type(exc).__name__}: {exc}"
    logging.getLogger("verl_qwen3vl_plugin").warning("verl-qwen3vl-plugin: start-up hook %s", message)
    return message


def _activate(_verl) -> None:
    global state
    try:
        if not enabled():  # a process may opt out after start-up, before it imports verl
            state = "off"
            return
        from verl_qwen3vl_plugin.activation import after_import_verl

        state = after_import_verl()
    except Exception as exc:  # never break `import verl`; say why, at WARNING
        state = _warn("failed", exc)


def _install() -> None:
    global state
    if not enabled() or "verl" in sys.modules:
        return
    try:
        from verl_qwen3vl_plugin.import_watch import after_import, waits_for

        if not waits_for("verl", _activate):
            after_import("verl", _activate)
            state = "waiting for verl"
    except Exception as exc:  # a broken install must not break `python`
        state = _warn("failed", exc)


_install()
