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
    function or class ``before``, with their imports made the file's (function-local imports of the upstream project
    hoisted to its import block). A module-level name of ``source`` they read comes with them: from the file where an
    earlier edit of the staging moved it (imported), else, if the file does not bind it, its assignment moved too
    (with the comment above it). ``replace``: (old, new) texts replaced in what is moved, each at least once (the
    plugin's own wording, such as its name in log messages), listed in ``PR.md``."""

    file: str
    source: ModuleType
    names: tuple[str, ...]
    before: str
    replace: tuple[tuple[str, str], ...] = ()
    note: str = ""


@dataclass(frozen=True)
class ReplaceFunction:
    """As ``MoveFunctions``, in place of the file's module-level function ``replaces`` (one of ``names``): the
    plugin's function of that name, which replaces upstream's at runtime, with the helpers it calls."""

    file: str
    source: ModuleType
    names: tuple[str, ...]
    replaces: str
    replace: tuple[tuple[str, str], ...] = ()
    note: str = ""


@dataclass(frozen=True)
class Decorate:
    """The ``functions`` of ``file`` (module-level, or methods as ``Class.method``) decorated with ``decorator``: the
    wrapper the plugin applies at runtime (``originals.wrap``), applied at definition instead; ``imports``: the import
    lines the decorator expression needs."""

    file: str
    functions: tuple[str, ...]
    decorator: str
    imports: tuple[str, ...] = ()
    note: str = ""


@dataclass(frozen=True)
class Constant:
    """A module-level ``name = <value>`` in ``file``, before its function or class ``before``: a value the plugin
    computes (its ``repr``, sets sorted), written out."""

    file: str
    name: str
    value: object
    before: str
    note: str = ""


Edit = ChangeArgument | PassKeyword | MoveFunctions | ReplaceFunction | Decorate | Constant


@dataclass(frozen=True)
class StagedTest:
    """A test file for upstream's layout: ``source`` (a path in this repository, named so that this repository's
    pytest does not collect it) lands at ``path`` in the base (``tests/.../test_*_on_cpu.py``)."""

    path: str
    source: str


@dataclass(frozen=True)
class Benchmark:
    """The measured numbers a pull request cites: the section of ``docs/performance.md`` headed ``section`` (its
    text, quoted whole in ``PR.md``, so the figures are told once) and the ``command`` that measures them."""

    section: str
    command: str


@dataclass(frozen=True)
class Staging:
    """One pull request: its base (a pip requirement, the sdist its diff is against), the title's parts (verl's
    ``[{modules}] {type}: {description}``), the edits and tests, ``backport_of`` (the release line, e.g. ``0.7.x``, when
    the fix is already on main), ``order`` (where it goes in the sending order: lower first) and ``stack`` (the
    ``noxfile.py`` stack the proof's venv is built from, where the first one pinning the base is not it: a fix for a
    transformers past verl's pin proves on a forward stack) and ``benchmark`` (for a speed-up, the figures it cites)."""

    base: str
    modules: tuple[str, ...]
    type: str
    description: str
    edits: tuple[Edit, ...]
    tests: tuple[StagedTest, ...]
    order: int
    backport_of: str | None = None
    fixed_on_main_by: tuple[str, ...] = ()
    stack: str | None = None
    benchmark: Benchmark | None = None
