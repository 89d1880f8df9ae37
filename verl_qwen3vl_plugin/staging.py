"""How a patch goes upstream: each patch's ``staging.py`` declares a ``STAGING``, and ``scripts/upstream.py`` turns it
into a ready pull request (``upstream/<patch>/verl.diff`` and ``PR.md``) and proves it on the patched upstream with the
plugin absent.

Descriptions only: no logic, no upstream import. Every edit takes its code text from the patch's own replacement
module (the functions or module it names), so the staged code is generated from the code the plugin runs, never kept
twice. Upstream files are named by their path in the base's source distribution, scopes by dotted names in that file
(``Class.method``, or a function). An edit's ``note`` (for reviewers: where the staged form differs from the runtime
wrapper, and why that is the same) follows its generated description in ``PR.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class ChangeArgument:
    """In ``scope``, each call of ``call`` gets its argument at ``position`` transformed as ``source`` transforms its
    parameter ``parameter`` before handing it on: the expression ``source`` passes in its place (``copy.deepcopy(x)``
    for ``parameter`` ``x``), with the call's own argument substituted."""

    file: str
    scope: str
    call: str
    position: int
    source: Callable
    parameter: str
    note: str = ""


@dataclass(frozen=True)
class PassKeyword:
    """In each of ``scopes``, each call of ``call`` passes ``keyword=<value>``, where the value is the expression the
    wrapper ``source`` stores in ``kwargs[keyword]`` (its defaulting branch)."""

    file: str
    scopes: tuple[str, ...]
    call: str
    keyword: str
    source: Callable
    note: str = ""


@dataclass(frozen=True)
class MoveFunctions:
    """The module-level functions ``names`` of the replacement module ``source``, moved into ``file`` before its
    function ``before``, with their imports made the file's (function-local imports of the upstream project hoisted to
    its import block)."""

    file: str
    source: ModuleType
    names: tuple[str, ...]
    before: str
    note: str = ""


@dataclass(frozen=True)
class Decorate:
    """The module-level ``functions`` of ``file`` decorated with ``decorator``: the wrapper the plugin applies at
    runtime (``originals.wrap``), applied at definition instead."""

    file: str
    functions: tuple[str, ...]
    decorator: str
    note: str = ""


Edit = ChangeArgument | PassKeyword | MoveFunctions | Decorate


@dataclass(frozen=True)
class StagedTest:
    """A test file for upstream's layout: ``source`` (a path in this repository, named so that this repository's
    pytest does not collect it) lands at ``path`` in the base (``tests/.../test_*_on_cpu.py``)."""

    path: str
    source: str


@dataclass(frozen=True)
class Staging:
    """One pull request: its base (a pip requirement, the sdist its diff is against), the title's parts (verl's
    ``[{modules}] {type}: {description}``), the edits and tests, ``backport_of`` (the release line, e.g. ``0.7.x``, when
    the fix is already on main) and ``order`` (where it goes in the sending order: lower first)."""

    base: str
    modules: tuple[str, ...]
    type: str
    description: str
    edits: tuple[Edit, ...]
    tests: tuple[StagedTest, ...]
    order: int
    backport_of: str | None = None
    fixed_on_main_by: tuple[str, ...] = ()
