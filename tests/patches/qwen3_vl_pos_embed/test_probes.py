"""The model-patch hook in real processes: ``import verl`` loads it, transformers' import triggers it, and verl's
``apply_monkey_patch`` on a tiny Qwen3-VL / Qwen3-VL-MoE (and Qwen3.5 / Qwen3.5-MoE, transformers >= 5.2) leaves the
plugin's function in effect. Its decisions on the installed transformers and on synthesized sources, through
``registry.decide``. On transformers >= 5.9, near-misses of its interpolation through vision_utils."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import POS_EMBED_USED, TRANSFORMERS, child_json, decide_text, source_text
from tests.source_edits import (
    APPLY,
    UNRECOGNIZED,
    NearMisses,
    Variant,
    check_near_miss,
    near_miss_cases,
    prepend_to,
    substitute,
)
from verl_qwen3vl_plugin import vision_towers
from verl_qwen3vl_plugin.patches.qwen3_vl_pos_embed.spec import FIXED_HELPERS
from verl_qwen3vl_plugin.patches.qwen3_vl_pos_embed.spec import PATCH as POS
from verl_qwen3vl_plugin.registry import Verdict

HERE = Path(__file__).parent  # this patch's child scripts

QWEN3_5 = TRANSFORMERS.release >= (5, 2)
METHOD_DEFINED = TRANSFORMERS.release < (5, 18)  # the vision classes' own fast_pos_embed_interpolate
VISION_MODULES = (
    "transformers.models.qwen3_vl.modeling_qwen3_vl",
    "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe",
    *(("transformers.models.qwen3_5.modeling_qwen3_5", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
      if QWEN3_5 else ()),
)  # fmt: skip
MODELS = ("dense", "moe", *(("qwen3_5", "qwen3_5_moe") if QWEN3_5 else ()))
MONKEY_PATCH = "verl.models.transformers.monkey_patch"


def test_plugin_function_in_effect_after_verl_monkey_patch():
    result = child_json(HERE / "build_and_patch.py")
    for module in VISION_MODULES:
        status, reason = result["status"][module]
        assert status == ("applied" if POS_EMBED_USED else "skipped"), reason
    # Wrapped on every verl: verl >= 0.8 sets its own method there, 0.7 does not, and the wrapper is right either way.
    assert result["status"][MONKEY_PATCH][0] == "applied"
    assert set(MODELS) <= set(result)
    for name in MODELS:
        assert result[name]["finite"]
        if POS_EMBED_USED:  # transformers >= 5.9 never calls the method: verl's unused copy may stay on the class
            assert result[name]["ours"], name


def test_without_the_plugin_nothing_is_patched():
    """The control for the test above: the same process with the plugin switched off keeps upstream's/verl's."""
    result = child_json(
        HERE / "build_and_patch.py", env={"VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_QWEN3VL_PLUGIN_AUTOLOAD": "0"}
    )
    assert result["status"] == {}
    assert not any(result[name]["ours"] for name in MODELS)


@pytest.mark.parametrize("names", ["all", "qwen3_vl_pos_embed", "qwen3_vl_pos_embed,npu_qwen3_vl_moe_routing"])
def test_disabled_by_name(names):
    result = child_json(HERE / "build_and_patch.py", env={"VERL_QWEN3VL_PLUGIN_DISABLE": names})
    assert {s for s, _ in result["status"].values()} == {"disabled"}
    assert not result["dense"]["ours"]


def _uses_vision_utils(module: str, helper: str) -> tuple[Variant, ...]:
    """transformers >= 5.9's interpolation through ``vision_utils``' ``helper``, near-missed in ``module``."""
    cls = vision_towers.VISION_CLASSES[module]
    return (
        Variant("renamed helper", module, substitute(rf"\b{helper}\(", "get_vision_weights(")),
        Variant("helper as an attribute call", module, substitute(rf"(?<!\.)\b{helper}\(", f"vision_utils.{helper}(")),
        Variant(
            "helper from another module",
            module,
            substitute(r"from \.\.\.vision_utils import", "from ...vision_helpers import"),
        ),
        Variant("helper on another grid", module, substitute(rf"({helper}\(\s*)grid_thw", r"\1grid_thw * 2")),
        # The patched method is called again: the patch replaces it, so it still works, where the class still has
        # it (transformers 5.18 removed it: a call of a missing method is not a shape the plugin can patch).
        Variant(
            "forward also calls the method",
            module,
            prepend_to(cls, "forward", "self.fast_pos_embed_interpolate(grid_thw)"),
            APPLY if METHOD_DEFINED else UNRECOGNIZED,
        ),
    )


NEAR_MISSES = [
    NearMisses("qwen3_vl_pos_embed", module, shape.id, _uses_vision_utils(module, helper))
    for module in vision_towers.VISION_CLASSES
    for helper, shape in FIXED_HELPERS.items()
]


@pytest.mark.parametrize(("patch", "target", "variant"), near_miss_cases(NEAR_MISSES))
def test_near_miss_of_a_safe_shape_is_not_called_safe(monkeypatch, patch, target, variant):
    check_near_miss(monkeypatch, patch, target, variant)


VISION = POS.target("transformers.models.qwen3_vl.modeling_qwen3_vl")


def test_installed_transformers_pos_embed_decision():
    for target in (VISION, POS.target("transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe")):
        decision = decide_text(POS, target, source_text(target.module))
        verdict, reason = decision.verdict, decision.reason
        assert verdict is (Verdict.APPLY if POS_EMBED_USED else Verdict.NOT_USED), reason


# Synthesized vision modules (``tests/test_decisions.py`` runs the real hook on the first and the last).
SYNTH_VISION = """
class Qwen3VLVisionModel:
    def fast_pos_embed_interpolate(self, grid_thw):
        return grid_thw

    def forward(self, hidden_states, grid_thw, **kwargs):
        return hidden_states + self.position_table(grid_thw)
"""
VISION_KNOWN_FIXED = "from ...vision_utils import get_vision_bilinear_indices_and_weights\n" + SYNTH_VISION.replace(
    "self.position_table(grid_thw)", "get_vision_bilinear_indices_and_weights(grid_thw)"
)
VISION_KNOWN_FIXED_5_16 = VISION_KNOWN_FIXED.replace(
    "get_vision_bilinear_indices_and_weights", "get_vision_interpolation_indices_and_weights"
)
VISION_AFFECTED = SYNTH_VISION.replace("self.position_table(grid_thw)", "self.fast_pos_embed_interpolate(grid_thw)")


def test_synthesized_vision_sources():
    assert decide_text(POS, VISION, SYNTH_VISION).verdict is Verdict.UNRECOGNIZED
    assert decide_text(POS, VISION, VISION_KNOWN_FIXED).verdict is Verdict.NOT_USED
    assert decide_text(POS, VISION, VISION_KNOWN_FIXED_5_16).shape == "tf5.16-vision-utils-interpolation"
    assert decide_text(POS, VISION, VISION_AFFECTED).verdict is Verdict.APPLY
    wrong_signature = VISION_AFFECTED.replace("(self, grid_thw):", "(self, grid_thw, scale):")
    assert decide_text(POS, VISION, wrong_signature).verdict is Verdict.UNRECOGNIZED


def test_synthesized_monkey_patch_sources():
    target = POS.target(MONKEY_PATCH)
    assert decide_text(POS, target, "def other():\n    pass\n").verdict is Verdict.UNRECOGNIZED
    # verl 0.7 sets none; the wrapper, which only puts the plugin's back afterwards, is right there too.
    assert decide_text(POS, target, "def apply_monkey_patch(model):\n    pass\n").verdict is Verdict.APPLY
    sets = "def apply_monkey_patch(model):\n    Qwen3VLVisionModel.fast_pos_embed_interpolate = f\n"
    assert decide_text(POS, target, sets).verdict is Verdict.APPLY
