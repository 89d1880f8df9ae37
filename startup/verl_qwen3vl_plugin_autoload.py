"""Start-up hook of verl-qwen3vl-plugin: loads the plugin's hooks right after ``import verl``, on every verl.

Why: verl 0.7.x and 0.8.0 load plugins only from ``VERL_USE_EXTERNAL_MODULES``, so a plain ``pip install`` would
leave them unpatched. ``site`` imports this module from ``verl_qwen3vl_plugin_autoload.pth`` in every Python process
of the environment (Ray workers included), before any user code.

How: at start-up it only puts a finder at the front of ``sys.meta_path`` that answers nothing but a lookup of
``verl``: most processes never import verl, and this module is all they pay for (budget: 300 us a start,
``benchmarks/startup_cost.py``). When verl is looked up, the finder removes itself and hands over to the package's
import watcher (``verl_qwen3vl_plugin.import_watch``), which calls ``verl_qwen3vl_plugin.activation`` once verl's
``__init__`` has run; activation leaves verl >= 0.9 to its own entry-point discovery. Nothing here may raise: a
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


class _VerlLookup:
    """The finder put in at start-up: it hands the first lookup of verl to the import watcher and leaves."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        global state
        if name != "verl":
            return None
        try:
            if _VerlLookup in sys.meta_path:
                sys.meta_path.remove(_VerlLookup)
            from verl_qwen3vl_plugin import import_watch

            import_watch.after_import("verl", _activate)
            # The import system has already passed the front of sys.meta_path, where the watcher's finder now sits,
            # so this lookup is answered through the watcher here.
            return import_watch.find_spec(name, path, target)
        except Exception as exc:  # verl then imports as if the plugin were not installed
            state = _warn("failed", exc)
            return None


def _install() -> None:
    global state
    if not enabled() or "verl" in sys.modules:
        return
    try:
        sys.meta_path.insert(0, _VerlLookup)
        state = "waiting for verl"
    except Exception as exc:  # a broken install must not break `python`
        state = _warn("failed", exc)


_install()
