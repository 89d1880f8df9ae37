"""Near-misses of the known safe shapes, edited from the real installed upstream source.

A ``fixed_upstream`` or ``not_used`` verdict must stand on a named upstream shape, not on a probe failing to see the
affected one. So each patch's test module lists, as ``NEAR_MISSES``, the safe shapes its probes recognise (by shape
id) and, for each, edits of the installed source that come close: a renamed helper, another call form, another op for
the same dense computation, an extra argument. Each must come out ``unrecognized``, or ``apply`` where the patch
provably still works on it. The edits are made on the source each stack installs, not on stored copies, so they
follow every release; ``tests/test_probe_variants.py`` checks that every safe verdict a stack shows has some.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, NamedTuple

import pytest

from tests.helpers import decide_text, source_text, use_sources
from verl_qwen3vl_plugin.patches import spec
from verl_qwen3vl_plugin.registry import Decision, Patch, Target, Verdict

if TYPE_CHECKING:
    from _pytest.mark import ParameterSet

Edit = Callable[[str], str]
Change = Callable[[ast.FunctionDef], None]
APPLY = Verdict.APPLY
UNRECOGNIZED = Verdict.UNRECOGNIZED
SAFE = (Verdict.FIXED_UPSTREAM, Verdict.NOT_USED)


def replace(old: str, new: str) -> Edit:
    """Replace every ``old``; fails where upstream no longer has it, so a stale edit cannot pass unchanged."""

    def edit(source: str) -> str:
        assert old in source, f"{old!r} is not in the source"
        return source.replace(old, new)

    return edit


def substitute(pattern: str, repl: str) -> Edit:
    """``re.sub`` that fails where the pattern matches nothing, like ``replace``."""

    def edit(source: str) -> str:
        edited, count = re.subn(pattern, repl, source)
        assert count, f"{pattern!r} matches nothing"
        return edited

    return edit


def append(code: str) -> Edit:
    """Add a module-level definition at the end: something new that a probe must not take for the known shape."""
    return lambda source: f"{source}\n\n{code}"


def in_method(cls: str, method: str, change: Change) -> Edit:
    """Edit one method's syntax tree, and print the module back: for changes that text replacement cannot place."""

    def edit(source: str) -> str:
        tree = ast.parse(source)
        scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
        change(next(n for n in scope.body if isinstance(n, ast.FunctionDef) and n.name == method))
        return ast.unparse(tree)

    return edit


def in_class(cls: str, change: Callable[[ast.ClassDef], None]) -> Edit:
    """Edit one class's syntax tree, and print the module back."""

    def edit(source: str) -> str:
        tree = ast.parse(source)
        change(next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls))
        return ast.unparse(tree)

    return edit


def statement(code: str) -> ast.stmt:
    """The first statement of ``code``, for inserting into a parsed module."""
    return ast.parse(code).body[0]


def prepend(code: str) -> Change:
    """Insert ``code`` at the top of a function body, after its docstring."""

    def change(func: ast.FunctionDef) -> None:
        docstring = isinstance(func.body[0], ast.Expr) and isinstance(func.body[0].value, ast.Constant)
        func.body.insert(1 if docstring else 0, statement(code))

    return change


def prepend_to(cls: str, method: str, code: str) -> Edit:
    """``code`` first in ``cls.method``: the method also does something the known shape does not."""
    return in_method(cls, method, prepend(code))


def before_return(code: str) -> Change:
    """Insert ``code`` before a function's last statement (its return)."""

    def change(func: ast.FunctionDef) -> None:
        func.body.insert(len(func.body) - 1, statement(code))

    return change


def extra_parameter(name: str, position: int | None = None) -> Change:
    """Add a parameter at ``position``, or last with a default of None."""

    def change(func: ast.FunctionDef) -> None:
        func.args.args.insert(len(func.args.args) if position is None else position, ast.arg(name))
        if position is None:
            func.args.defaults.append(ast.Constant(None))

    return change


def add_method(code: str) -> Callable[[ast.ClassDef], None]:
    """Append the method ``code`` defines to a class (for ``in_class``)."""
    return lambda cls: cls.body.append(statement(code))


def guard_scatter(func: ast.FunctionDef) -> None:
    """Move the block's top-level scatter under ``if not self.training:``: verl 0.7.1's shape."""
    index = next(i for i, s in enumerate(func.body) if "scatter_" in ast.unparse(s))
    func.body[index] = ast.If(test=ast.parse("not self.training", mode="eval").body, body=[func.body[index]], orelse=[])


def scatter_unless_training(func: ast.FunctionDef) -> None:
    """The top-level scatter written as ``x = <scatter> if not self.training else x``: verl 0.7.1's bug, inline."""
    index = next(i for i, s in enumerate(func.body) if "scatter_" in ast.unparse(s))
    stmt = func.body[index]
    target = ast.unparse(stmt.targets[0])
    func.body[index] = statement(f"{target} = ({ast.unparse(stmt.value)}) if not self.training else {target}")


def scatter_not_in_place(func: ast.FunctionDef) -> None:
    """Every ``x.scatter_(...)`` -> ``x.scatter(...)``: the routing weights no longer written in place."""
    for node in ast.walk(func):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "scatter_":
            node.func.attr = "scatter"


def unpermute_with_float_weights(func: ast.FunctionDef) -> None:
    """Every ``probs=...`` keyword -> ``probs=routing_weights.float()``: the experts unpermute with another weight."""
    for node in ast.walk(func):
        for keyword in node.keywords if isinstance(node, ast.Call) else ():
            if keyword.arg == "probs":
                keyword.value = ast.parse("routing_weights.float()", mode="eval").body


def rename_stream_keys(func: ast.FunctionDef) -> None:
    """``(name, tensor) for name, param in ...`` -> ``(rename(name), tensor) ...``: names no longer as stored."""
    gen = next(n for n in ast.walk(func) if isinstance(n, ast.GeneratorExp))
    gen.elt.elts[0] = ast.parse("rename(name)", mode="eval").body


class Variant(NamedTuple):
    name: str
    module: str  # whose source is edited: the target's own, or one its probe reads
    edit: Edit
    expected: Verdict = UNRECOGNIZED  # or APPLY, where the patch provably still works on it


class NearMisses(NamedTuple):
    """Near-misses of a known safe shape: the patch's name, the target's label, the shape's id, and the edits."""

    patch: str
    target: str
    shape: str
    variants: tuple[Variant, ...]


def safe_decision(patch: Patch, target: Target, absent: bool = False) -> Decision | None:
    """The installed source's decision where it is safe; None otherwise. A module this stack does not have has no
    shape of its own to miss; with ``absent``, its target's ``absent`` decision counts, whose probe reads other
    modules that near-misses can edit (verl >= 0.8's engine, where the legacy actor is gone)."""
    source = source_text(target.module)
    decision = decide_text(patch, target, source) if source is not None or absent else None
    return decision if decision is not None and decision.verdict in SAFE else None


def shows(shape: NearMisses, patch: Patch, target: Target, decision: Decision) -> bool:
    """Whether ``decision`` is ``shape``'s: by the probe's stable shape id, never by its reason's wording."""
    return (shape.patch, shape.target, shape.shape) == (patch.name, target.label, decision.shape)


def near_miss_cases(shapes: Iterable[NearMisses]) -> list[ParameterSet]:
    """``(patch, target, variant)`` for each near-miss of the shapes this stack shows, with readable ids."""
    cases = []
    for shape in shapes:
        patch = spec(shape.patch)
        target = patch.target(shape.target)
        decision = safe_decision(patch, target, absent=True)
        if decision is not None and shows(shape, patch, target, decision):
            cases += [
                pytest.param(patch, target, v, id=f"{patch.name}-{target.label}-{v.name}") for v in shape.variants
            ]
    return cases


def check_near_miss(monkeypatch: pytest.MonkeyPatch, patch: Patch, target: Target, variant: Variant) -> None:
    """The verdict on the edited source: the target's own, or one its probe reads, edited."""
    assert variant.module in {target.module, *target.reads}, f"{target.label}'s probe does not read {variant.module}"
    base = source_text(variant.module)
    edited = variant.edit(base)
    assert edited != base
    if variant.module == target.module:
        decision = decide_text(patch, target, edited)
    else:
        use_sources(monkeypatch, {variant.module: edited})
        decision = decide_text(patch, target, source_text(target.module))
    assert decision.verdict is variant.expected, decision
