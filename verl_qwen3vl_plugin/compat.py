"""Version and code probes: the facts about the installed verl and transformers that the patches decide on.

Decisions read the installed code (a version string says nothing about a backport or a fork), always through its
syntax tree: a probe names the shapes it knows, and anything else is the patch's ``unrecognized`` verdict. Sources
are found without importing them, so the doctor can judge an Ascend module on a machine without ``torch_npu``, and
each is parsed once per process (``installed``).
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
def installed(name: str) -> Source:
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
    return installed(name).tree


def find_class(module: ast.Module | None, name: str) -> ast.ClassDef | None:
    if module is None:
        return None
    return next((n for n in module.body if isinstance(n, ast.ClassDef) and n.name == name), None)


def find_function(scope: ast.Module | ast.ClassDef | None, name: str) -> ast.FunctionDef | None:
    """A function defined at the top of a module, or a method of a class."""
    if scope is None:
        return None
    return next((n for n in scope.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def parameters(func: ast.FunctionDef) -> list[str]:
    return [a.arg for a in func.args.posonlyargs + func.args.args]


def call_nodes(node: ast.AST, name: str) -> list[ast.Call]:
    """The calls of ``name(...)`` or ``<anything>.name(...)`` in ``node``."""
    return [
        n
        for n in ast.walk(node)
        if isinstance(n, ast.Call)
        and (
            (isinstance(n.func, ast.Name) and n.func.id == name)
            or (isinstance(n.func, ast.Attribute) and n.func.attr == name)
        )
    ]


def calls(node: ast.AST, name: str) -> bool:
    """Whether ``node`` calls ``name(...)`` or ``<anything>.name(...)``."""
    return bool(call_nodes(node, name))


def calls_self(node: ast.AST, method: str) -> bool:
    """Whether ``node`` calls ``self.<method>(...)``."""
    return any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == method
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "self"
        for n in ast.walk(node)
    )


def assigns_attribute(node: ast.AST, attr: str) -> bool:
    """Whether ``node`` assigns ``<anything>.<attr> = ...``."""
    return any(
        isinstance(n, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == attr for t in n.targets)
        for n in ast.walk(node)
    )


def empty_shape(init: ast.FunctionDef, parameter: str) -> list[str] | None:
    """``self.<parameter> = nn.Parameter(torch.empty(<dims>))``: the dims as source text."""
    for node in ast.walk(init):
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Attribute) and t.attr == parameter for t in node.targets)
            and isinstance(node.value, ast.Call)
            and node.value.args
            and isinstance(empty := node.value.args[0], ast.Call)
            and calls(empty, "empty")
        ):
            dims = empty.args[0].elts if len(empty.args) == 1 and isinstance(empty.args[0], ast.Tuple) else empty.args
            return [ast.unparse(d) for d in dims]
    return None


def is_not_training(test: ast.expr) -> bool:
    """``not self.training`` (or ``not <x>.training``)."""
    return (
        isinstance(test, ast.UnaryOp)
        and isinstance(test.op, ast.Not)
        and isinstance(test.operand, ast.Attribute)
        and test.operand.attr == "training"
    )


def called_decorator(func: ast.FunctionDef | None, name: str) -> bool:
    """Whether ``func`` is decorated with a call of ``name`` (``@name(...)``)."""
    return func is not None and any(
        isinstance(d, ast.Call) and isinstance(d.func, ast.Name) and d.func.id == name for d in func.decorator_list
    )


def has_string(node: ast.AST, value: str) -> bool:
    return any(isinstance(n, ast.Constant) and n.value == value for n in ast.walk(node))


def mentions(node: ast.AST, text: str) -> bool:
    """Whether a string literal, a name or an attribute in ``node`` contains ``text``."""
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and text in n.value:
            return True
        if (isinstance(n, ast.Name) and text in n.id) or (isinstance(n, ast.Attribute) and text in n.attr):
            return True
    return False


def verl_discovers_plugins() -> bool:
    """Whether ``import verl`` loads the ``verl.plugins`` entry points (verl >= 0.9; older verl never looks).

    Read from verl's ``__init__.py`` without importing verl. Unreadable source counts as no discovery: the start-up
    hook then loads the plugin itself, which is harmless where verl would have too (hooks install once).
    """
    source = tree("verl")
    return source is not None and has_string(source, "verl.plugins")


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
