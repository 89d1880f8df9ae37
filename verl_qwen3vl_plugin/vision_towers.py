"""The vision towers the vision patches target: Qwen3-VL's and Qwen3.5's share one design (patch embedding, an
interpolated position table, the blocks, the merger), so each vision patch acts on all four classes alike.

transformers ships ``qwen3_5`` and ``qwen3_5_moe`` from 5.2: where they are not installed, their targets are "not
used", while a missing Qwen3-VL module stays "unrecognized" (every supported transformers has it).
"""

from __future__ import annotations

import ast
from collections.abc import Callable

from verl_qwen3vl_plugin.registry import Decision, Target, not_used_when_absent

VISION_CLASSES = {
    "transformers.models.qwen3_vl.modeling_qwen3_vl": "Qwen3VLVisionModel",
    "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe": "Qwen3VLMoeVisionModel",
    "transformers.models.qwen3_5.modeling_qwen3_5": "Qwen3_5VisionModel",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe": "Qwen3_5MoeVisionModel",
}


def is_qwen3_5(cls_name: str) -> bool:
    return cls_name.startswith("Qwen3_5")


NO_QWEN3_5 = not_used_when_absent(
    "no-qwen3.5-transformers", "no Qwen3.5 in this transformers (it ships qwen3_5 from 5.2)"
)


def vision_targets(
    decide: Callable[[str, ast.Module | None], Decision], apply: Callable[[type], None], reads: tuple[str, ...] = ()
) -> tuple[Target, ...]:
    """One target per vision class, judged by ``decide(class name, module tree)``; ``apply`` gets the class."""

    def target(module: str, cls_name: str) -> Target:
        return Target(
            module=module,
            decide=lambda tree: decide(cls_name, tree),
            apply=lambda imported, decision: apply(getattr(imported, cls_name)),
            absent=NO_QWEN3_5 if is_qwen3_5(cls_name) else None,
            reads=reads,
        )

    return tuple(target(module, cls_name) for module, cls_name in VISION_CLASSES.items())
