"""The model families the plugin patches, in one table: everything else (transformers' module paths, class names,
verl's forward modules, the labels in messages, and the version gates of the probes and the tests) derives from it.

Qwen3-VL and Qwen3.5 are two model lines of one design (vision tower, merger, a decoder that takes the vision
embeddings), each with a dense and an MoE member.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Family:
    model_type: str  # transformers' model_type, which names its module
    prefix: str  # transformers' class-name prefix
    line: str  # the model line, its dense and MoE members alike
    moe: bool
    transformers: tuple[int, ...]  # the first transformers release that ships it
    verl: tuple[int, ...]  # the first verl release that trains it

    @property
    def label(self) -> str:
        return f"{self.line}-MoE" if self.moe else self.line

    @property
    def modeling(self) -> str:
        return f"transformers.models.{self.model_type}.modeling_{self.model_type}"

    @property
    def vision_class(self) -> str:
        return f"{self.prefix}VisionModel"

    @property
    def line_prefix(self) -> str:
        """The dense member's prefix, which verl's code names for the whole line."""
        return self.prefix.removesuffix("Moe")

    @property
    def verl_forward(self) -> str:
        """verl's module holding the line's forward (``verl.models.transformers.qwen3_vl``)."""
        return f"verl.models.transformers.{self.model_type.removesuffix('_moe')}"

    def shipped_by(self, transformers: tuple[int, ...]) -> bool:
        return transformers >= self.transformers

    def trained_by(self, verl: tuple[int, ...], transformers: tuple[int, ...]) -> bool:
        return verl >= self.verl and self.shipped_by(transformers)

    def missing(self, what: str) -> str:
        """Why a target of this family is "not used" where ``what`` (transformers or verl) lacks it."""
        first = self.transformers if what == "transformers" else self.verl
        return f"no {self.label} in this {what} (it has {self.model_type} from {'.'.join(map(str, first))})"


QWEN3_VL = Family(
    model_type="qwen3_vl", prefix="Qwen3VL", line="Qwen3-VL", moe=False, transformers=(4, 57), verl=(0, 7)
)
QWEN3_VL_MOE = Family(
    model_type="qwen3_vl_moe", prefix="Qwen3VLMoe", line="Qwen3-VL", moe=True, transformers=(4, 57), verl=(0, 7)
)
QWEN3_5 = Family(model_type="qwen3_5", prefix="Qwen3_5", line="Qwen3.5", moe=False, transformers=(5, 2), verl=(0, 8))
QWEN3_5_MOE = Family(
    model_type="qwen3_5_moe", prefix="Qwen3_5Moe", line="Qwen3.5", moe=True, transformers=(5, 2), verl=(0, 8)
)
FAMILIES = (QWEN3_VL, QWEN3_VL_MOE, QWEN3_5, QWEN3_5_MOE)
