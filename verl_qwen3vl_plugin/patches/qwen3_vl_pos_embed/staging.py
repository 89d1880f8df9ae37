"""``qwen3_vl_pos_embed`` as a transformers pull request: read by ``scripts/upstream.py``.

**This pull request** edits the modular file (`modular_qwen3_vl.py`) and the two modeling files generated from it
alike (`modeling_qwen3_vl.py`, and `modeling_qwen3_vl_moe.py`, whose vision model the converter copies from
Qwen3-VL's): the interpolation's helpers sit at module level before each vision model class, and its
`fast_pos_embed_interpolate` takes the method's place. `utils/modular_model_converter.py` (not in the sdist) was not
run on it: CI's repo-consistency check tells whether it writes the modeling files exactly so (where it places the
copied helpers, for one). The moved code runs on Python 3.9, which transformers 4.57 supports: `zip(...,
strict=True)` loses `strict` (every zip there pairs parts of equal length) and `X | None` becomes `Optional[X]`.
"""

from verl_qwen3vl_plugin.patches.qwen3_vl_pos_embed import replacement
from verl_qwen3vl_plugin.staging import Benchmark, MoveFunctions, ReplaceMethod, StagedTest, Staging

MODULAR = "src/transformers/models/qwen3_vl/modular_qwen3_vl.py"
MODELING = "src/transformers/models/qwen3_vl/modeling_qwen3_vl.py"
MOE_MODELING = "src/transformers/models/qwen3_vl_moe/modeling_qwen3_vl_moe.py"
# The helpers, in the order their definitions need (annotations read _GridTables when each def runs: no
# `from __future__ import annotations` in transformers' model files).
HELPERS = (
    "_GridTables",
    "validate_grid_thw",
    "_grid",
    "_grid_tables",
    "_patch_positions",
    "_corners",
    "_steps",
    "_step_rows",
    "_BilinearGather",
    "_frame_rows",
)
# Python 3.9, which transformers 4.57 supports, evaluates annotations and has no zip(strict=...).
PY39 = ((", strict=True", ""), ("torch.Tensor | None", "Optional[torch.Tensor]"))
# The plugin's "upstream" is the per-image loop this replaces: in transformers, the old loop (same lengths, so the
# comments keep their width).
WORDING = (
    ("upstream returns wrong shapes or fails", "the loop returned wrong shapes or failed"),
    (
        "# The call upstream makes, on the CPU as upstream does: the exact values upstream interpolates with.",
        "# The call the old loop made, on the CPU as it did: the exact values it interpolated with.",
    ),
    ("(upstream repeats each frame t times)", "(the old loop repeated each frame t times)"),
    ("Upstream's corner order", "The old loop's corner order"),
    ("upstream's", "the old loop's"),
    ("(benchmarks/pos_embed.py --sweep-steps)", "(verl-qwen3vl-plugin's benchmarks/pos_embed.py --sweep-steps)"),
)
METHOD_WORDING = (
    # A method documents its arguments, not self.
    (
        "        self: a ``Qwen3VLVisionModel`` or ``Qwen3VLMoeVisionModel`` (uses ``pos_embed``, "
        "``num_grid_per_side`` and\n            ``config.spatial_merge_size``).\n",
        "",
    ),
    ("like upstream's lookup", "like the old loop's lookup"),
    ("(as upstream repeats it)", "(as the old loop repeated it)"),
)


def _edits(file: str, vision_class: str) -> tuple:
    return (
        MoveFunctions(file=file, source=replacement, names=HELPERS, before=vision_class, replace=(*PY39, *WORDING)),
        ReplaceMethod(
            file=file,
            source=replacement,
            function="fast_pos_embed_interpolate",
            method=f"{vision_class}.fast_pos_embed_interpolate",
            replace=METHOD_WORDING,
        ),
    )


STAGING = Staging(
    base="transformers==4.57.6",
    modules=(),
    type="",
    description=(
        "[Qwen3-VL] Compute fast_pos_embed_interpolate on grid_thw's device, vectorized (fixes FSDP2 CPU offload)"
    ),
    edits=(
        *_edits(MODULAR, "Qwen3VLVisionModel"),
        *_edits(MODELING, "Qwen3VLVisionModel"),
        *_edits(MOE_MODELING, "Qwen3VLMoeVisionModel"),
    ),
    tests=(
        StagedTest(
            path="tests/models/qwen3_vl/test_modeling_qwen3_vl_pos_embed.py",
            source="tests/patches/qwen3_vl_pos_embed/staged_modeling_qwen3_vl_pos_embed.py",
        ),
    ),
    order=90,
    backport_of="v4.57-release",
    fixed_on_main_by=("transformers#45396",),
    stack="verl0.7.1-tf4.57.6",
    benchmark=Benchmark(section="Results (current code)", command="nox -s bench"),
)
