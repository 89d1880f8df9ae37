"""The vision towers the vision patches target: Qwen3-VL's and Qwen3.5's share one design (patch embedding, an
interpolated position table, the blocks, the merger), so each vision patch acts on every family's tower alike.

A family the installed transformers does not ship yet (Qwen3.5 before 5.2) has targets that are "not used", while a
missing module of a family every supported transformers ships stays "unrecognized".
"""

from __future__ import annotations

import ast
from collections.abc import Callable

from verl_qwen3vl_plugin.families import FAMILIES, QWEN3_VL, Family
from verl_qwen3vl_plugin.registry import Decision, Target, not_used_when_absent

# transformers module -> its vision class
VISION_CLASSES = {family.modeling: family.vision_class for family in FAMILIES}


def vision_targets(
    decide: Callable[[Family, ast.Module], Decision], apply: Callable[[type], None], reads: tuple[str, ...] = ()
) -> tuple[Target, ...]:
    """One target per family's tower, judged by ``decide(family, module tree)``; ``apply`` gets the class."""

    def target(family: Family) -> Target:
        shipped_always = family.transformers <= QWEN3_VL.transformers
        return Target(
            module=family.modeling,
            decide=lambda tree: decide(family, tree),
            apply=lambda imported, decision: apply(getattr(imported, family.vision_class)),
            absent=None
            if shipped_always
            else not_used_when_absent(f"no-{family.model_type}", family.missing("transformers")),
            reads=reads,
        )

    return tuple(target(family) for family in FAMILIES)
