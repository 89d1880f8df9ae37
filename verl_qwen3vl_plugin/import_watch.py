"""Call back once a module is imported: the one mechanism the start-up hook (waiting for ``verl``) and the registry
(waiting for each patch's targets) share.

One finder sits at the front of ``sys.meta_path`` while something is waited for. It answers only for the modules
waited for: it asks the other finders for the module's spec, wraps the loader, and once the module's code has run,
calls what waits for it. It removes itself once nothing is waiting. Standard library only, and nothing here raises
into an import: the start-up hook imports this module in every Python process of the environment that imports verl.
"""

import _thread
import sys

# Module name -> what to call once it has been imported (each callback once); the lock keeps a callback from being
# added while another thread's import hands the list out.
_waiting: dict = {}
_lock = _thread.RLock()


def after_import(name: str, callback) -> None:
    """Call ``callback(module)`` once the module ``name`` is imported: now if it already is, else right after its
    code has run."""
    with _lock:
        module = sys.modules.get(name)
        ready = module is not None
        if not ready:
            _waiting.setdefault(name, []).append(callback)
            if _Finder not in sys.meta_path:
                sys.meta_path.insert(0, _Finder)
    if ready:
        _call(callback, module)


def find_spec(name: str, path=None, target=None):
    """The watcher's finder: for a module waited for, the spec the other finders give, its loader wrapped to call
    what waits once the module's code has run; None for any other module, and for one no other finder finds.

    The start-up hook calls it for the lookup of verl that is already under way when it starts waiting for verl.
    """
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
    find_spec = staticmethod(find_spec)
