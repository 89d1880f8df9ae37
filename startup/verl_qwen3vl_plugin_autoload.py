"""Start-up hook of verl-qwen3vl-plugin: loads the plugin's hooks right after ``import verl``, on every verl.

Why: verl 0.7.x and 0.8.0 load plugins only from ``VERL_USE_EXTERNAL_MODULES``, so a plain ``pip install`` would
leave them unpatched. ``site`` imports this module from ``verl_qwen3vl_plugin_autoload.pth`` in every Python process
of the environment (Ray workers included), before any user code.

How: it puts one finder at the front of ``sys.meta_path`` that answers only for the modules it waits for (here
``verl``). It asks the other finders for the module's spec, wraps the loader, and once verl's ``__init__`` has run,
hands over to ``verl_qwen3vl_plugin.activation``, which leaves verl >= 0.9 to its own entry-point discovery. The
finder removes itself once nothing is waiting. Until verl is imported nothing beyond this module is imported (``os``
and ``sys`` are loaded at start-up anyway), and nothing here may raise: a broken plugin must not break ``python``.
The plugin's registry waits for its patches' target modules through ``after_import`` too.

Off: ``VERL_QWEN3VL_PLUGIN_AUTOLOAD=0`` (read at start-up, and again when verl is imported). ``python -S`` skips
``.pth`` files; there, ``VERL_USE_EXTERNAL_MODULES`` still works.
"""

import _thread
import os
import sys

ENV = "VERL_QWEN3VL_PLUGIN_AUTOLOAD"
# What this hook did in this process: "off", "waiting for verl", or what activation returned once verl was imported.
state = "off"


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def after_import(name: str, callback) -> None:
    """Call ``callback(module)`` once the module ``name`` is imported: now if it already is, else right after its
    code has run. The plugin's registry watches its patches' targets through this too, so one finder serves both."""
    with _lock:
        module = sys.modules.get(name)
        ready = module is not None
        if not ready:
            _waiting.setdefault(name, []).append(callback)
            if _Finder not in sys.meta_path:
                sys.meta_path.insert(0, _Finder)
    if ready:
        _call(callback, module)


# Module name -> what to call once it has been imported (each callback once); the lock keeps a callback from being
# added while another thread's import hands the list out.
_waiting: dict = {}
_lock = _thread.RLock()


def _call(callback, module) -> None:
    """A callback that raises must not fail the import of its module, nor keep the others from running."""
    try:
        callback(module)
    except Exception as exc:
        import logging

        logging.getLogger("verl_qwen3vl_plugin").warning(
            "verl-qwen3vl-plugin: a callback after importing %s failed: %s: %s",
            module.__name__,
            type(exc).__name__,
            exc,
        )


class _NotifyingLoader:
    """The module's own loader, plus the callbacks waiting for it once its code has run."""

    def __init__(self, loader, name):
        self._loader, self._name = loader, name

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self._loader  # the module sees its own loader
        self._loader.exec_module(module)
        with _lock:
            callbacks = _waiting.pop(self._name, ())
            if not _waiting and _Finder in sys.meta_path:
                sys.meta_path.remove(_Finder)
        for callback in callbacks:
            _call(callback, module)


class _Finder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name not in _waiting:
            return None
        for finder in sys.meta_path:  # the remaining finders, in the order the import system asks them
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None and finder is not _Finder else None
            if spec is not None:
                if getattr(spec.loader, "exec_module", None) is not None:
                    spec.loader = _NotifyingLoader(spec.loader, name)
                return spec
        return None


def _activate(_verl) -> None:
    global state
    try:
        if not enabled():  # a process may opt out after start-up, before it imports verl
            state = "off"
            return
        from verl_qwen3vl_plugin.activation import after_import_verl

        state = after_import_verl()
    except Exception as exc:  # never break `import verl`; say why, at WARNING
        state = f"failed: {type(exc).__name__}: {exc}"
        import logging

        logging.getLogger("verl_qwen3vl_plugin").warning("verl-qwen3vl-plugin: start-up hook %s", state)


def _install() -> None:
    global state
    if enabled() and "verl" not in sys.modules and _activate not in _waiting.get("verl", ()):
        after_import("verl", _activate)
        state = "waiting for verl"


_install()
