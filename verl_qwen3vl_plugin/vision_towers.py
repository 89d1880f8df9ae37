"""The vision towers the vision patches target: Qwen3-VL's and Qwen3.5's share one design (patch embedding, an
interpolated position table, the blocks, the merger), so each vision patch acts on every family's tower alike.

A family the installed transformers does not ship yet (Qwen3.5 before 5.2) has targets that are "not used", while a
missing module of a family every supported transformers ships stays "unrecognized".
"""

from __future__ import annotations

import ast
from collections.abc import Callable

from verl_qwen3vl_plugin.families import FAMILIES, QWEN3_VL, Family
from verl_qwen3vl_plugin.family_shapes import absent_family, shipped
from verl_qwen3vl_plugin.registry import Decision, Shape, Target

# transformers module -> its vision class
VISION_CLASSES = {family.modeling: family.vision_class for family in FAMILIES}


def vision_targets(
    probe: Callable[[Family, ast.Module], Decision],
    apply: Callable[[type], None],
    shapes: tuple[Shape, ...],
    reads: tuple[str, ...] = (),
) -> tuple[Target, ...]:
    """One target per family's tower, probed by ``probe(family, module tree)``; ``apply`` gets the class.
    ``shapes`` are the towers' shapes; a family shipped later than Qwen3-VL sees them from its first release and its
    own absent shape before it."""

    def target(family: Family) -> Target:
        later = family.transformers > QWEN3_VL.transformers
        absent = absent_family(family)
        return Target(
            module=family.modeling,
            probe=lambda tree: probe(family, tree),
            apply=lambda imported, decision: apply(getattr(imported, family.vision_class)),
            absent=absent.when_absent(family.missing("transformers")) if later else None,
            reads=reads,
            shapes=(absent, *(s.narrowed(transformers=shipped(family)) for s in shapes)) if later else shapes,
        )

    return tuple(target(family) for family in FAMILIES)
