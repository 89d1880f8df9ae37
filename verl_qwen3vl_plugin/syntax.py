"""Shapes of upstream code, read from its syntax tree: the small vocabulary every probe is written in (find a class
or a function, its parameters, what it calls, assigns or mentions). Nothing here imports or reads a file."""

from __future__ import annotations

import ast


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
