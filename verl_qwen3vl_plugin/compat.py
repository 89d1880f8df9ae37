"""Version and code probes: the facts about the installed verl/transformers that the patches decide on.

Decisions look at the installed code where they can (a version string says nothing about a backport or a fork),
and fall back to versions only where the code cannot be read.
"""

from __future__ import annotations

import importlib.util
import inspect
from importlib import metadata
from pathlib import Path

from packaging.version import Version


def dist_version(name: str) -> Version | None:
    """Installed version of a distribution, or None when it is not installed."""
    try:
        return Version(metadata.version(name))
    except metadata.PackageNotFoundError:
        return None


def method_calls(cls: type, method: str, callee: str) -> bool:
    """Whether ``cls.<method>``'s source calls ``self.<callee>(`` (False when the source cannot be read)."""
    try:
        source = inspect.getsource(getattr(cls, method))
    except (OSError, TypeError):
        return False
    return f"self.{callee}(" in source


def module_source(name: str) -> str | None:
    """Source text of an installed module, located without importing it or its packages (None if not found)."""
    top, *rest = name.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location, *rest[:-1], f"{rest[-1]}.py") if rest else Path(spec.origin)
        if path.is_file():
            return path.read_text()
    return None


def verl_discovers_plugins() -> bool:
    """Whether ``import verl`` imports the ``verl.plugins`` entry points (verl >= 0.9; older verl never looks).

    Read from verl's ``__init__.py`` without importing verl; the version decides only if the file is unreadable.
    """
    spec = importlib.util.find_spec("verl")
    if spec is None:
        return False
    try:
        return '"verl.plugins"' in Path(spec.origin).read_text()
    except (OSError, TypeError):
        version = dist_version("verl")
        return version is not None and version >= Version("0.9.0")
