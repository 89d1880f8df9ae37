"""How a patch goes upstream: each patch's ``staging.py`` declares a ``STAGING``, and ``scripts/upstream.py`` turns it
into a ready pull request (``upstream/<patch>/<package>.diff`` and ``PR.md``) and proves it on the patched upstream with
the plugin absent.

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
    hoisted to its import block, those the file makes already dropped). A module-level name of ``source`` they read
    comes with them: from the file where an earlier edit of the staging moved it (imported), else, if the file does
    not bind it, its assignment moved too (with the comment above it); one they import from another of the plugin's
    modules, only from where an earlier edit moved it. ``replace``: (old, new) texts replaced in what is moved, each at
    least once (the plugin's own wording, such as its name in log messages), listed in ``PR.md``."""

    file: str
    source: ModuleType
    names: tuple[str, ...]
    before: str
    replace: tuple[tuple[str, str], ...] = ()
    note: str = ""


@dataclass(frozen=True)
class ReplaceFunction:
    """As ``MoveFunctions``, in place of the file's module-level function ``replaces`` (one of ``names``): the
    plugin's function of that name, which replaces upstream's at runtime, with the helpers it calls. ``by``: the one
    of ``names`` that takes its place where the plugin's function has a name of its own (the plugin sets the module's
    attribute, whatever its function is called): moved under upstream's name, and imported by that name where a later
    edit's moved code reads it."""

    file: str
    source: ModuleType
    names: tuple[str, ...]
    replaces: str
    replace: tuple[tuple[str, str], ...] = ()
    note: str = ""
    by: str | None = None


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


@dataclass(frozen=True)
class Unguard:
    """In ``scope``, the ``if`` statement whose test is ``test`` (its source text; it has no ``else``) replaced by its
    body, dedented: the plugin's ``source`` calls ``call`` under no condition (checked on its source), where upstream
    calls it only under that guard. For a fix that is upstream's own statement run in every case, which the plugin
    runs as part of a whole replaced function."""

    file: str
    scope: str
    test: str
    source: Callable
    call: str
    note: str = ""


@dataclass(frozen=True)
class ReplaceMethod:
    """The method ``method`` (``Class.name``) of ``file`` replaced by the replacement module's function
    ``function``, which the plugin sets on that class at runtime: renamed to the method's name, indented into the
    class, its ``self`` without annotation. The module-level names it reads must be the file's already, or moved
    there by an earlier edit (``MoveFunctions``); its imports are made the file's. ``replace``: as
    ``MoveFunctions``'."""

    file: str
    source: ModuleType
    function: str
    method: str
    replace: tuple[tuple[str, str], ...] = ()
    note: str = ""


@dataclass(frozen=True)
class WrapAttribute:
    """In ``scope``, right after its statement ``after`` (the statement's source text), ``owner.attribute =
    wrapper(owner.attribute)`` for each of ``owners`` (names bound there): the wrapper the plugin applies at import
    (``originals.wrap``) applied where upstream patches those classes. ``wrapper``: the plugin's name of a function an
    earlier edit moved into ``file``."""

    file: str
    scope: str
    after: str
    owners: tuple[str, ...]
    attribute: str
    wrapper: str
    note: str = ""


@dataclass(frozen=True)
class NewModule:
    """A module upstream lacks, ``file``, made of the replacement module ``source``: its docstring (its first
    ``paragraphs``, where given), and its module-level statements (those binding ``names``, where given), each with
    the comment lines above it, in their order, with the imports they read. For replacement code that is a module of
    its own, moved whole rather than spread over upstream's files. The plugin's modules it imports are the new modules
    earlier ``NewModule`` edits made of them (a module import stays a module import); a plugin constant it imports
    from a module none made is moved in. A new package gets an empty ``__init__.py``. ``replace``: as
    ``MoveFunctions``', over the docstring and statements moved."""

    file: str
    source: ModuleType
    names: tuple[str, ...] = ()
    paragraphs: int | None = None
    replace: tuple[tuple[str, str], ...] = ()
    note: str = ""


@dataclass(frozen=True)
class CallAfter:
    """In ``scope`` of ``file``, right after its statement that begins with ``after``, ``function`` (a function an
    earlier edit moved) called on each of ``classes`` (``module.Class``), both imported there as verl's branches of
    ``apply_monkey_patch`` import what they patch: the call the plugin's ``source`` (the hook it runs when
    transformers imports ``module``) makes, checked on its source. For code the plugin installs on a class when its
    module is imported, which upstream installs where it patches that model."""

    file: str
    scope: str
    after: str
    function: str
    classes: tuple[str, ...]
    source: Callable
    note: str = ""


@dataclass(frozen=True)
class ReadThrough:
    """In each of ``scopes`` (functions of ``file`` whose first parameter is the object read), each read of an
    attribute of ``attributes`` on that parameter, ``self.name``, becomes ``reader(self, "name")``: for attributes
    the plugin puts back on upstream's classes at runtime (``originals.add``) as what ``reader`` computes, read
    through ``reader`` where they are used instead. ``reader`` is a replacement function an earlier edit of the
    staging moved into ``file``; every attribute is read at least once, every scope reads one."""

    file: str
    scopes: tuple[str, ...]
    attributes: tuple[str, ...]
    reader: Callable
    note: str = ""


Edit = (
    ChangeArgument
    | PassKeyword
    | MoveFunctions
    | ReplaceFunction
    | Decorate
    | Constant
    | Unguard
    | ReplaceMethod
    | WrapAttribute
    | NewModule
    | CallAfter
    | ReadThrough
)


@dataclass(frozen=True)
class StagedTest:
    """A test file for upstream's layout: ``source`` (a path in this repository, named so that this repository's
    pytest does not collect it) lands at ``path`` in the base (``tests/.../test_*_on_cpu.py``)."""

    path: str
    source: str


@dataclass(frozen=True)
class Overlap:
    """An upstream pull request for the same bug, read before sending this one: ``pr`` (``verl#7323``), its ``state``
    when read (``open``, ``merged``, ``stale``: open with conflicts) and ``advice``: whether to review it instead, and
    what this one adds."""

    pr: str
    state: str
    advice: str


@dataclass(frozen=True)
class Benchmark:
    """The measured numbers a pull request cites: the section of ``docs/performance.md`` headed ``section`` (its
    text, quoted whole in ``PR.md``, so the figures are told once) and the ``command`` that measures them."""

    section: str
    command: str


@dataclass(frozen=True)
class Staging:
    """One pull request: its base (a pip requirement, the sdist its diff is against), the title's parts (verl's
    ``[{modules}] {type}: {description}``; transformers has no rule: the description alone, ``modules`` and ``type``
    empty), the edits and tests, ``backport_of`` (the release branch, ``release/v0.7.1`` or ``v4.57-release``, when
    main is fixed already), ``order`` (where it goes in the sending order: lower first), ``stack`` (the
    ``noxfile.py`` stack the proof's venv is built from, where the first one pinning the base is not it: a fix for a
    transformers past verl's pin proves on a forward stack), ``benchmark`` (for a speed-up, the figures it cites) and
    ``overlaps`` (upstream pull requests for the same bug: the README says which to review first)."""

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
    overlaps: tuple[Overlap, ...] = ()
