"""Patch ``qwen3_vl_vision_dp``: the Qwen3-VL and Qwen3-VL-MoE vision towers split their images over verl's Ulysses
group instead of every rank running all of them.

Targets: transformers' two Qwen3-VL modeling modules (wrap the vision class's ``forward``). Each decision reads two
sources, since the patch is only right where both hold:
- the vision ``forward(self, hidden_states, grid_thw, **kwargs)`` returns the merged embeddings and the deepstack
  features, as a 2-tuple (transformers 4.57) or ``BaseModelOutputWithDeepstackFeatures`` (5.x);
- verl's ``apply_monkey_patch`` slices VLM inputs at the language model's entry
  (``patch_vlm_for_ulysses_input_slicing``, verl 0.7.0 to 0.9.1), so every rank of the group holds every image.
The wrapper does nothing until verl sets a Ulysses group of more than one rank.
"""

from __future__ import annotations

import ast
from types import ModuleType

from verl_qwen3vl_plugin import compat
from verl_qwen3vl_plugin.registry import MODEL, Decision, Patch, Target, Verdict

VISION_CLASSES = {
    "transformers.models.qwen3_vl.modeling_qwen3_vl": "Qwen3VLVisionModel",
    "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe": "Qwen3VLMoeVisionModel",
}
SIGNATURE = ["self", "hidden_states", "grid_thw"]
OUTPUT_CLASS = "BaseModelOutputWithDeepstackFeatures"
VERL_MONKEY_PATCH = "verl.models.transformers.monkey_patch"
VERL_SLICER = "patch_vlm_for_ulysses_input_slicing"


def _returns_embeds_and_deepstack(forward: ast.FunctionDef) -> bool:
    for node in ast.walk(forward):
        if isinstance(node, ast.Return) and node.value is not None:
            value = node.value
            if isinstance(value, ast.Tuple) and len(value.elts) == 2:
                return True
            if isinstance(value, ast.Call) and compat.calls(value, OUTPUT_CLASS):
                return True
    return False


def decide_verl(tree: ast.Module | None) -> Decision:
    """Whether verl runs the vision tower before it slices the sequence: the premise of the whole patch."""
    func = compat.find_function(tree, "apply_monkey_patch") if tree is not None else None
    if func is None:
        return Decision(Verdict.UNRECOGNIZED, f"no apply_monkey_patch in {VERL_MONKEY_PATCH}")
    slices_qwen3_vl = any(
        isinstance(node, ast.Call) and compat.calls(node, VERL_SLICER) and compat.mentions(node, "Qwen3VL")
        for node in ast.walk(func)
    )
    if slices_qwen3_vl:
        return Decision(Verdict.APPLY, f"verl slices Qwen3-VL inputs after the vision tower ({VERL_SLICER})")
    return Decision(Verdict.UNRECOGNIZED, f"verl's apply_monkey_patch does not call {VERL_SLICER} for Qwen3-VL")


def decide_vision_class(cls_name: str, tree: ast.Module) -> Decision:
    forward = compat.find_function(compat.find_class(tree, cls_name), "forward")
    if forward is None:
        return Decision(Verdict.UNRECOGNIZED, f"no {cls_name}.forward in this transformers")
    if compat.parameters(forward) != SIGNATURE or forward.args.kwarg is None:
        return Decision(Verdict.UNRECOGNIZED, f"{cls_name}.forward is not (self, hidden_states, grid_thw, **kwargs)")
    if not _returns_embeds_and_deepstack(forward):
        return Decision(Verdict.UNRECOGNIZED, f"{cls_name}.forward returns neither a pair nor {OUTPUT_CLASS}")
    verl = decide_verl(compat.tree(VERL_MONKEY_PATCH))
    if verl.verdict is not Verdict.APPLY:
        return verl
    reason = f"{cls_name} runs every image on every Ulysses rank; {verl.reason}; acts when SP > 1"
    return Decision(Verdict.APPLY, reason)


def _apply_to_vision_class(module: ModuleType) -> None:
    from verl_qwen3vl_plugin.replacements.qwen3_vl_vision_dp import vision_dp_forward

    cls = getattr(module, VISION_CLASSES[module.__name__])
    cls.forward = vision_dp_forward(cls.__dict__["forward"])


def _vision_target(module: str, cls_name: str) -> Target:
    return Target(module, lambda tree: decide_vision_class(cls_name, tree), _apply_to_vision_class)


PATCH = Patch(
    name="qwen3_vl_vision_dp",
    group=MODEL,
    targets=tuple(_vision_target(module, cls_name) for module, cls_name in VISION_CLASSES.items()),
    devices=None,
    why=(
        "With Ulysses sequence parallelism verl slices a VLM's sequence only at the language model, after the "
        "vision tower: every rank of the SP group runs the tower on every image of the micro-batch, forward and "
        "backward, and holds its activations. At SP 8 that is 8 times the vision work."
    ),
    how=(
        "verl_qwen3vl_plugin.replacements.qwen3_vl_vision_dp.vision_dp_forward"
        " wraps the vision forward: contiguous runs of whole "
        "images, balanced by patch count, one per rank (a one-token dummy for a rank without one); embeddings and "
        "deepstack features all-gathered back in order; their backward sums over the group."
    ),
    upstream=("verl#5230",),
    remove_when="verl shards the vision tower over the Ulysses group itself (verl#5230 or a successor) in the "
    "oldest verl you run.",
    selftest="verl_qwen3vl_plugin.selftest.qwen3_vl_vision_dp",
)
