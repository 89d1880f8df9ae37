"""The shapes of verl's weight-sync streams, read from syntax: what the probes of the patches that act on the sync
(the Ascend split, the per-expert sync) both need to recognise."""

from __future__ import annotations

import ast


def keeps_names(value: ast.expr) -> bool:
    """Whether a stream expression hands on the module's own names as stored: ``params`` (verl 0.7.0),
    ``params.items()``, or ``((name, <expr>) for name, param in params.items())``."""
    if ast.unparse(value) in ("params", "params.items()"):
        return True
    if not (isinstance(value, ast.GeneratorExp) and len(value.generators) == 1):
        return False
    loop = value.generators[0]
    return (
        ast.unparse(loop.iter) == "params.items()"
        and not loop.ifs
        and isinstance(loop.target, ast.Tuple)
        and isinstance(value.elt, ast.Tuple)
        and len(value.elt.elts) == 2
        and ast.unparse(value.elt.elts[0]) == ast.unparse(loop.target.elts[0])
    )
