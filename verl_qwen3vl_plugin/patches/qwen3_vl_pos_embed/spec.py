"""Targets of ``qwen3_vl_pos_embed``: transformers' four modeling modules, where the plugin's function is set on the
vision class (a missing Qwen3.5 module is "not used"), and verl's ``monkey_patch``, whose ``apply_monkey_patch`` may
set verl's own copies while it builds a model: it is wrapped to put the plugin's function back afterwards, on the
classes the plugin patched.

- ``METHOD_ON_TABLE_DEVICE``: the vision ``forward`` calls ``self.fast_pos_embed_interpolate``, a method of
  ``(self, grid_thw)``.
- ``FIXED_HELPERS``, one shape per helper's name: the module imports the helper from ``vision_utils`` (relative
  import), and the vision ``forward`` calls it by that name on ``grid_thw``.
- ``SETS_OWN_METHOD``: ``apply_monkey_patch`` assigns a ``fast_pos_embed_interpolate`` attribute.
- ``SETS_NO_METHOD``: it assigns none. The wrapper is right either way, so this target has no "not used" verdict to
  reach by not seeing an assignment.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable
from types import ModuleType

from verl_qwen3vl_plugin import originals, syntax, vision_towers
from verl_qwen3vl_plugin.families import Family
from verl_qwen3vl_plugin.registry import MODEL, Decision, Patch, Shape, Target, Verdict, unrecognized
from verl_qwen3vl_plugin.upstream import MONKEY_PATCH

METHOD = "fast_pos_embed_interpolate"
METHOD_ON_TABLE_DEVICE = Shape(id="tf4.57-method-on-table-device", verdict=Verdict.APPLY, transformers="<5.9")
# Newer transformers compute the interpolation with a pure function of grid_thw, on its device: the helper's name,
# and the shape of the transformers that calls it.
FIXED_HELPERS = {
    "get_vision_bilinear_indices_and_weights": Shape(
        id="tf5.9-vision-utils-interpolation", verdict=Verdict.NOT_USED, transformers=">=5.9,<5.16"
    ),
    "get_vision_interpolation_indices_and_weights": Shape(
        id="tf5.16-vision-utils-interpolation", verdict=Verdict.NOT_USED, transformers=">=5.16"
    ),
}
SETS_OWN_METHOD = Shape(id="verl0.8-sets-own-method", verdict=Verdict.APPLY, verl=">=0.8")
SETS_NO_METHOD = Shape(id="verl0.7-sets-no-method", verdict=Verdict.APPLY, verl="<0.8")


def _imports_helper(tree: ast.Module, helper: str) -> bool:
    """``from ...vision_utils import <helper>``, at the top of the module."""
    return any(
        isinstance(n, ast.ImportFrom)
        and n.module == "vision_utils"
        and n.level > 0
        and any(a.name == helper and a.asname is None for a in n.names)
        for n in tree.body
    )


def _calls_helper_on_grid(forward: ast.FunctionDef, helper: str) -> bool:
    """``<helper>(grid_thw, ...)``, by its bare name."""
    return any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id == helper
        and n.args
        and ast.unparse(n.args[0]) == "grid_thw"
        for n in ast.walk(forward)
    )


def probe_vision_class(family: Family, tree: ast.Module) -> Decision:
    cls_name = family.vision_class
    cls = syntax.find_class(tree, cls_name)
    forward, method = syntax.find_function(cls, "forward"), syntax.find_function(cls, METHOD)
    if forward is None:
        return unrecognized(f"no {cls_name}.forward in this transformers")
    if syntax.calls_self(forward, METHOD):
        if method is None or syntax.parameters(method) != ["self", "grid_thw"]:
            return unrecognized(f"{cls_name}.forward calls {METHOD}, but not one of (self, grid_thw)")
        return METHOD_ON_TABLE_DEVICE.decision(f"{cls_name}.forward calls {METHOD}, which builds on pos_embed's device")
    for helper, shape in FIXED_HELPERS.items():
        if _imports_helper(tree, helper) and _calls_helper_on_grid(forward, helper):
            return shape.decision(f"{cls_name}.forward calls vision_utils.{helper} on grid_thw")
    return unrecognized(f"{cls_name}.forward calls neither {METHOD} nor a vision_utils interpolation helper as known")


def probe_monkey_patch(tree: ast.Module) -> Decision:
    """Wrapping is right on any ``apply_monkey_patch``: the wrapper passes every argument through and, after it
    returns, puts the plugin's method back on the classes the plugin patched, however verl set its own."""
    func = syntax.find_function(tree, "apply_monkey_patch")
    if func is None:
        return unrecognized("verl's monkey_patch has no apply_monkey_patch")
    if syntax.assigns_attribute(func, METHOD):
        return SETS_OWN_METHOD.decision(f"apply_monkey_patch sets verl's {METHOD}: the plugin's is put back")
    return SETS_NO_METHOD.decision(f"apply_monkey_patch sets no {METHOD} as verl 0.8 does: wrapped all the same")


def _apply_to_vision_class(cls: type) -> None:
    from verl_qwen3vl_plugin.patches.qwen3_vl_pos_embed.replacement import fast_pos_embed_interpolate

    originals.replace(cls, METHOD, fast_pos_embed_interpolate)


def _putting_ours_back(apply_monkey_patch: Callable) -> Callable:
    @functools.wraps(apply_monkey_patch)
    def wrapper(*args, **kwargs):
        result = apply_monkey_patch(*args, **kwargs)
        for cls in originals.replaced(METHOD):  # only the classes the plugin patched: a skipped one stays so
            _apply_to_vision_class(cls)
        return result

    return wrapper


def _wrap_apply_monkey_patch(module: ModuleType, decision: Decision) -> None:
    originals.wrap(module, "apply_monkey_patch", _putting_ours_back)


DETAILS = """\
**The failure.** With FSDP2 CPU offload (`actor_rollout_ref.actor.fsdp_config.offload_policy=True`) the first vision
forward of Qwen3-VL or Qwen3-VL-MoE stops in `fast_pos_embed_interpolate` with `RuntimeError: Expected all tensors to
be on the same device, but found at least two devices, cuda:0 and cpu!` (`npu:0 and cpu` on Ascend). Under offload
`self.pos_embed.weight.device` is the CPU when the method runs, while the patches and the all-gathered table are on
the accelerator. The same error is reported in verl #4906 (closed), verl #5571 (Ascend, open), trl #4771 and
torchtitan #2195.

**verl's own copies.** verl#6131 set a device-fixed copy on both Qwen3-VL vision classes, imported from verl's
Qwen3.5 module, and verl#6332 moved it into `verl/models/transformers/qwen3_vl.py` because that import broke verl's
CI. verl's copies are correct, but they keep the per-image loop with a `.tolist()` per corner, so on verl >= 0.8 the
plugin only adds speed. transformers#41536 was an earlier fix of the same symptom for parameters on the meta device.
transformers#45396 moved the index math into `transformers.vision_utils`, on `grid_thw`'s device.

**What the tests hold.** FSDP gathers the table only inside `pos_embed`'s own forward, so reading `.weight` directly
would see a shard. `tests/patches/qwen3_vl_pos_embed/test_fsdp2.py` runs a sharded tower on two FSDP2 ranks on the
CPU. `tests/patches/qwen3_vl_pos_embed/test_numerics.py` finds the output bit-identical to transformers' method and to
verl's copies, fp32 and bf16, on Qwen3-VL and Qwen3.5 towers, with the table's gradient. A `grid_thw` that is not
`(N, 3)` integers, has a side below 1, or has an h or w that `spatial_merge_size` does not divide gets a `ValueError`
naming the rows. An empty grid gives a `(0, hidden)` tensor, where upstream fails in `torch.cat`. Speed, memory and
the cost of a first call on a new grid size are in `docs/performance.md`.

Not covered here: transformers #45859 and PR #45861, the text M-RoPE `inv_freq` buffer left on the CPU under FSDP2
CPU offload (another function).

**Upstream plan.** The function would replace `fast_pos_embed_interpolate` in `verl/models/transformers/qwen3_vl.py`
and its copy in `verl/models/transformers/qwen3_5.py`. The hook is not needed there, since `apply_monkey_patch`
already sets verl's function on the classes. PR title:
`[model] perf: vectorize Qwen3-VL fast_pos_embed_interpolate on grid_thw's device, validate grid_thw`. The numeric
tests (bit-identity in fp32 and bf16, gradients, bad and empty grids) would go to a `*_on_cpu.py` file beside verl's
model tests, with the numbers of `benchmarks/pos_embed.py` and, on a GPU, `benchmarks/gpu_check.py` attached.
"""

PATCH = Patch(
    name="qwen3_vl_pos_embed",
    title="device-safe, vectorized `fast_pos_embed_interpolate`",
    group=MODEL,
    targets=(
        *vision_towers.vision_targets(
            probe_vision_class, _apply_to_vision_class, (METHOD_ON_TABLE_DEVICE, *FIXED_HELPERS.values())
        ),
        Target(
            module=MONKEY_PATCH,
            probe=probe_monkey_patch,
            apply=_wrap_apply_monkey_patch,
            shapes=(SETS_OWN_METHOD, SETS_NO_METHOD),
        ),
    ),
    why=(
        "transformers 4.57.x to 5.8.x build the interpolation's index and weight tensors on the position table's "
        "device, the CPU under FSDP2 CPU offload: the vision forward fails with a device mismatch. Everywhere, it "
        "loops over images in Python with a host sync per patch list."
    ),
    how=(
        "verl_qwen3vl_plugin.patches.qwen3_vl_pos_embed.replacement.fast_pos_embed_interpolate"
        " replaces the method on the four "
        "vision classes: "
        "computed on grid_thw's device, vectorized, one host sync per call, bit-identical output."
    ),
    upstream=("verl#6131", "verl#6332", "transformers#45396", "transformers#41536"),
    remove_when="transformers >= 5.9 is the oldest transformers you run Qwen3-VL and Qwen3.5 with.",
    details=DETAILS,
)
