"""Targets of ``qwen3_vl_single_vision_call``: verl's ``verl.models.transformers.qwen3_vl`` and
``verl.models.transformers.qwen3_5``. ``apply_monkey_patch`` makes ``qwen3_vl_base_forward`` and
``qwen3_5_base_forward`` the forwards of the family's models, and each looks up its module's ``_get_input_embeds``
at each call, so replacing the module's name is enough, before or after ``apply_monkey_patch``.

Both tower shapes have ``_get_input_embeds(model, input_ids, attention_mask, pixel_values, pixel_values_videos,
image_grid_thw, video_grid_thw)`` and no other parameters, called by the module's ``<model_type>_base_forward``, and
one ``return`` of a dict with the keys of ``OUTPUTS``.

- ``TWO_TOWER_CALLS``: three ``model.visual(...)`` calls, one under a top-level ``if pixel_values is not None``, one
  under ``if pixel_values_videos is not None`` and the text-only dummy.
- ``ONE_TOWER_CALL``: two calls, in neither of those branches and in no loop: the text-only dummy (under ``if
  pixel_values is None and pixel_values_videos is None``) and one whose pixels are ``torch.cat`` of the media, inline
  or through a name the same top-level statement assigns.
- ``NO_VERL_QWEN3_5``: verl has no ``qwen3_5`` module.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from types import ModuleType

from verl_qwen3vl_plugin import originals, syntax
from verl_qwen3vl_plugin.families import QWEN3_5, QWEN3_VL, Family
from verl_qwen3vl_plugin.family_shapes import absent_in_verl
from verl_qwen3vl_plugin.registry import MODEL, Decision, Patch, Shape, Target, Verdict, unrecognized

FUNCTION = "_get_input_embeds"
PARAMETERS = [
    "model", "input_ids", "attention_mask", "pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw",
]  # fmt: skip
# Per model line (its verl forward module): the keys of the dict the function returns; Qwen3-VL's add the deepstack.
OUTPUTS = {
    QWEN3_VL: {"inputs_embeds", "attention_mask", "visual_pos_masks", "deepstack_visual_embeds"},
    QWEN3_5: {"inputs_embeds", "attention_mask"},
}


TWO_TOWER_CALLS = Shape(id="verl0.7-two-tower-calls", verdict=Verdict.APPLY, verl=">=0.7,<0.10")
ONE_TOWER_CALL = Shape(id="verl7323-one-tower-call", verdict=Verdict.FIXED_UPSTREAM, elsewhere="verl#7323's branch")
NO_VERL_QWEN3_5 = absent_in_verl(QWEN3_5)


def _tower_calls(node: ast.AST) -> list[ast.Call]:
    """The ``model.visual(...)`` calls ``node`` holds."""
    return [n for n in syntax.call_nodes(node, "visual") if ast.unparse(n.func) == "model.visual"]


def _branch(func: ast.FunctionDef, name: str) -> ast.If | None:
    """The top-level ``if <name> is not None:`` of ``func``."""
    for node in func.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == f"{name} is not None":
            return node
    return None


LOOPS = (ast.For, ast.While, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _joins_media_in_one_call(func: ast.FunctionDef) -> bool:
    """verl#7323's shape: besides the text-only dummy, one tower call, in no loop, whose pixels are ``torch.cat`` of
    the media, inline or through a name the same statement assigns that to."""
    dummy = "pixel_values is None and pixel_values_videos is None"
    calling = [n for n in func.body if _tower_calls(n) and not (isinstance(n, ast.If) and ast.unparse(n.test) == dummy)]
    if len(calling) != 1 or any(isinstance(n, LOOPS) and _tower_calls(n) for n in ast.walk(func)):
        return False
    towers = _tower_calls(calling[0])
    if len(towers) != 1:
        return False
    joined = {
        target.id
        for n in ast.walk(calling[0])
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and ast.unparse(n.value.func) == "torch.cat"
        for target in n.targets
        if isinstance(target, ast.Name)
    }
    pixels = towers[0].args[0] if towers[0].args else None
    return (isinstance(pixels, ast.Call) and ast.unparse(pixels.func) == "torch.cat") or (
        isinstance(pixels, ast.Name) and pixels.id in joined
    )


def _returns_outputs(func: ast.FunctionDef, outputs: set[str]) -> bool:
    returns = [n.value for n in ast.walk(func) if isinstance(n, ast.Return)]
    return (
        len(returns) == 1
        and isinstance(returns[0], ast.Dict)
        and {k.value for k in returns[0].keys if isinstance(k, ast.Constant)} == outputs
    )


def probe(tree: ast.Module, family: Family = QWEN3_VL) -> Decision:
    caller_name, outputs = f"{family.model_type}_base_forward", OUTPUTS[family]
    func = syntax.find_function(tree, FUNCTION)
    if func is None:
        return unrecognized(f"no {FUNCTION} in {family.verl_forward}")
    if syntax.parameters(func) != PARAMETERS or func.args.vararg or func.args.kwarg or func.args.kwonlyargs:
        return unrecognized(f"{FUNCTION} is not ({', '.join(PARAMETERS)})")
    caller = syntax.find_function(tree, caller_name)
    if caller is None or not any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == FUNCTION for n in ast.walk(caller)
    ):
        return unrecognized(f"{caller_name} does not call the module's {FUNCTION}")
    if not _returns_outputs(func, outputs):
        return unrecognized(f"{FUNCTION} does not return the dict of {sorted(outputs)}")
    image, video = _branch(func, "pixel_values"), _branch(func, "pixel_values_videos")
    calls = tuple(len(_tower_calls(node)) if node is not None else 0 for node in (image, video, func))
    if calls == (1, 1, 3):
        return TWO_TOWER_CALLS.decision(
            f"{FUNCTION} calls the tower for images and again for videos: two calls on a mixed batch"
        )
    if calls == (0, 0, 2) and _joins_media_in_one_call(func):
        return ONE_TOWER_CALL.decision(
            f"{FUNCTION} joins images and videos with torch.cat into one tower call (verl#7323)"
        )
    return unrecognized(f"{FUNCTION} does not call model.visual as verl 0.7.0 to 0.9.1 do (image, video, dummy)")


def _applier(replacement: str) -> Callable[[ModuleType, Decision], None]:
    def apply(module: ModuleType, decision: Decision) -> None:
        from verl_qwen3vl_plugin.patches.qwen3_vl_single_vision_call import replacement as replacements

        originals.replace(module, FUNCTION, replacements.naming_strays(getattr(replacements, replacement)))

    return apply


DETAILS = """\
**Seen.** `tests/patches/qwen3_vl_single_vision_call/test_in_effect.py` runs verl's own forward (verl 0.7.1's actor,
verl 0.9.1's engine) on two FSDP2 ranks on the CPU. With the patch disabled, rank 0 (an image and a video) makes two
tower calls, rank 1 makes one, and both ranks fail within the test's time bounds.

**Details of the change.** verl's token-count `ValueError`s ("Image features and image tokens do not match", and the
video one) are kept. With `qwen3_vl_vision_dp` the one call's images and videos are split over the Ulysses group
together. Against verl's own function on a tiny Qwen3-VL and a tiny Qwen3.5 (image and video, video before image,
images only, video only, text only), every case makes one tower call. Where verl also makes one call, outputs and
tower gradients are bit-identical. Where verl makes two, they agree within 1e-5 of each tensor's largest entry. Two
FSDP2 ranks holding different media (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE) make the same calls, and their
log-probs and gradients match each micro-batch computed alone. Speed: `docs/performance.md`.

**Upstream plan.** `get_input_embeds` would replace `_get_input_embeds` in `verl/models/transformers/qwen3_vl.py`,
and `get_input_embeds_qwen3_5` the one in `verl/models/transformers/qwen3_5.py`. `split_output`
(`verl_qwen3vl_plugin/patches/qwen3_vl_vision_dp/replacement.py`, which unpacks the tower's tuple or transformers 5
output) moves with them. No hook is needed upstream, since `qwen3_vl_base_forward` calls the module's function.
Review verl#7323, or send `[model] fix: one vision-tower call per micro-batch in Qwen3-VL _get_input_embeds`. The
comparison with verl's function and the two-rank check would go to a `*_on_cpu.py` file beside verl's model tests.
"""

PATCH = Patch(
    name="qwen3_vl_single_vision_call",
    title="one vision-tower call per micro-batch",
    group=MODEL,
    targets=(
        Target(
            module=QWEN3_VL.verl_forward,
            probe=probe,
            apply=_applier("get_input_embeds"),
            shapes=(TWO_TOWER_CALLS, ONE_TOWER_CALL),
        ),
        Target(
            module=QWEN3_5.verl_forward,
            probe=lambda tree: probe(tree, QWEN3_5),
            apply=_applier("get_input_embeds_qwen3_5"),
            absent=NO_VERL_QWEN3_5.when_absent(QWEN3_5.missing("verl")),
            shapes=(NO_VERL_QWEN3_5, TWO_TOWER_CALLS.narrowed(verl=">=0.8"), ONE_TOWER_CALL),
        ),
    ),
    why=(
        "verl's Qwen3-VL and Qwen3.5 forwards call the vision tower once for a micro-batch's images and once more "
        "for its videos. Under FSDP each call is a collective, so a rank whose micro-batch mixes an image and a video "
        "makes two calls while its peers make one: the run hangs (NCCL), exchanges wrong parameters, or fails (gloo)."
    ),
    how=(
        "verl_qwen3vl_plugin.patches.qwen3_vl_single_vision_call.replacement.get_input_embeds"
        " (and get_input_embeds_qwen3_5) replace verl's _get_input_embeds: "
        "images and videos through the tower in one call, split back and scattered as verl does; text-only keeps "
        "verl's one dummy call; one host sync."
    ),
    upstream=("verl#7323", "verl#3491"),
    remove_when="verl's Qwen3-VL and Qwen3.5 _get_input_embeds make one vision-tower call per micro-batch in the "
    "oldest verl you run.",
    details=DETAILS,
)
