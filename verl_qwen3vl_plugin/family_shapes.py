"""What several patches' probes say alike about a model family that an installed release does not ship yet: its
modules are "not used" there, under one shape per family and project, told once here."""

from __future__ import annotations

import ast

from verl_qwen3vl_plugin import environment
from verl_qwen3vl_plugin.families import Family
from verl_qwen3vl_plugin.registry import Decision, Shape, Verdict, unrecognized


def _version(release: tuple[int, ...]) -> str:
    return ".".join(map(str, release))


def shipped(family: Family) -> str:
    """The transformers releases that ship ``family``, as a release range (``narrowed``'s argument)."""
    return f">={_version(family.transformers)}"


def absent_family(family: Family) -> Shape:
    """A transformers before ``family``'s first release: its modeling module is missing, and not used."""
    return Shape(
        id=f"no-{family.model_type}", verdict=Verdict.NOT_USED, transformers=f"<{_version(family.transformers)}"
    )


def absent_in_verl(family: Family) -> Shape:
    """A verl before it trains ``family``: verl's forward module of the family is missing, and not used."""
    return Shape(id=f"no-verl-{family.line.lower()}", verdict=Verdict.NOT_USED, verl=f"<{_version(family.verl)}")


def verl_forward_tree(family: Family) -> ast.Module | Decision:
    """verl's forward module of ``family``, parsed; where this verl has none, ``absent_in_verl``'s decision; where it
    cannot be read, ``unrecognized``."""
    source = environment.source_of(family.verl_forward)
    if source.tree is not None:
        return source.tree
    if source.missing:
        return absent_in_verl(family).decision(family.missing("verl"))
    return unrecognized(f"{family.verl_forward} {source.problem}")
