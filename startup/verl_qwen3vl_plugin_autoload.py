"""Start-up hook of verl-qwen3vl-plugin: loads the plugin's hooks right after ``import verl``, on every verl.

Off: ``VERL_QWEN3VL_PLUGIN_AUTOLOAD=0`` (read at start-up, and again when verl is imported). ``python -S`` skips
``.pth`` files; there, ``VERL_USE_EXTERNAL_MODULES`` still works.
"""

# Why: verl 0.7.x and 0.8.0 load plugins only from ``VERL_USE_EXTERNAL_MODULES``, so a plain ``pip install`` would
# leave them unpatched. ``site`` imports this module from ``verl_qwen3vl_plugin_autoload.pth`` in every Python process
# of the environment (Ray workers included), before any user code.
#
# How: at start-up this module only puts itself at the front of ``sys.meta_path``, as a finder (its ``find_spec``)
# that answers nothing but a lookup of verl. Most processes never import verl, and loading this module is all they
# pay: the budget is 300 us a start (``benchmarks/startup_cost.py``), so the text of this header stays in comments,
# which the bytecode does not carry, and there is no class to build. When verl is looked up, the finder removes itself
# and hands over to the package's import watcher (``verl_qwen3vl_plugin.import_watch``), which calls
# ``verl_qwen3vl_plugin.activation`` once verl's ``__init__`` has run; activation leaves verl >= 0.9 to its own
# entry-point discovery. Nothing here may raise: a broken plugin must not break ``python``.

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


def find_spec(name, path=None, target=None):
    """The finder's one answer: the first lookup of verl goes to the import watcher, which waits for verl from then on;
    any other name is not this finder's."""
    global state
    if name != "verl":
        return None
    try:
        finder = sys.modules[__name__]
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
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
        sys.meta_path.insert(0, sys.modules[__name__])
        state = "waiting for verl"
    except Exception as exc:  # a broken install must not break `python`
        state = _warn("failed", exc)


_install()
