"""The facts of this environment the patches decide on: the installed distributions' versions, the installed
upstream modules' parsed sources, and the accelerators this process can use.

Decisions read the installed code (a version string says nothing about a backport or a fork), always through its
syntax tree (``syntax`` holds the vocabulary): a probe names the shapes it knows, and anything else is the patch's
``unrecognized`` verdict. Sources are found without importing them, so the doctor can probe an Ascend module on a
machine without ``torch_npu``, and each is parsed once per process (``source_of``).
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from functools import cache, lru_cache
from importlib import metadata
from pathlib import Path
from typing import NamedTuple

from packaging.version import Version

from verl_qwen3vl_plugin import syntax


def dist_version(name: str) -> Version | None:
    """Installed version of a distribution, or None when it is not installed."""
    try:
        return Version(metadata.version(name))
    except metadata.PackageNotFoundError:
        return None


def module_path(name: str) -> Path | None:
    """The file of a module: the one imported, where it is; else located without importing it or its packages
    (None if there is none)."""
    file = getattr(sys.modules.get(name), "__file__", None)
    if file is not None:
        return Path(file)
    top, *rest = name.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        if not rest:
            path = Path(location, "__init__.py")
        else:
            path = Path(location, *rest[:-1], f"{rest[-1]}.py")
            if not path.is_file():
                path = Path(location, *rest, "__init__.py")
        if path.is_file():
            return path
    return None


MISSING = "is not installed"


class Source(NamedTuple):
    """A module's parsed source, or why there is none (``problem``: missing, unreadable or unparsable)."""

    tree: ast.Module | None
    problem: str = ""

    @property
    def missing(self) -> bool:
        return self.problem == MISSING


def parse(text: str) -> Source:
    try:
        return Source(ast.parse(text))
    except SyntaxError as exc:
        return Source(None, f"does not parse: {exc}")


@cache
def source_of(name: str) -> Source:
    """The installed module's source, read without importing it and parsed once per process (every probe, hook and
    the doctor share this cache)."""
    path = module_path(name)
    if path is None:
        return Source(None, MISSING)
    try:
        return parse(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        return Source(None, f"cannot be read: {exc}")


def tree(name: str) -> ast.Module | None:
    """The installed module's syntax tree; None where it is missing, unreadable or unparsable."""
    return source_of(name).tree


def verl_discovers_plugins() -> bool:
    """Whether ``import verl`` loads the ``verl.plugins`` entry points (verl >= 0.9; older verl never looks).

    Read from verl's ``__init__.py`` without importing verl. Unreadable source counts as no discovery: the start-up
    hook then loads the plugin itself, which is harmless where verl would have too (each target is watched once).
    """
    source = tree("verl")
    return source is not None and syntax.has_string(source, "verl.plugins")


@lru_cache(maxsize=1)
def devices() -> dict[str, bool]:
    """The accelerators this process can use: what tells an applied patch that runs here from one that does not."""
    import torch

    npu = False
    if dist_version("torch_npu") is not None:
        try:
            import torch_npu  # noqa: F401

            npu = torch.npu.is_available()
        except Exception:  # a broken torch_npu means no usable NPU, not a crash of the doctor or the status API
            npu = False
    return {"cuda": torch.cuda.is_available(), "npu": npu}
