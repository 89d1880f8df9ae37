"""``qwen3_vl_vision_dp`` as a verl pull request: read by ``scripts/upstream.py``.

**This pull request** splits the vision tower of Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE over the Ulysses
group whenever SP > 1, wrapped in ``apply_monkey_patch`` where verl sets up the group's input slicing. It stands alone:
with verl's two tower calls on a micro-batch holding images and videos, each call is split on its own. verl#5230
(open: opt-in through a ``vision_dp`` flag, Qwen2-VL, Qwen2.5-VL, Qwen3-VL and GLM-4V, in a new
``verl/utils/vision_dp.py``) is the proposal it follows; this one covers Qwen3.5 too, first checks that every rank of
the group holds the same images (a mismatch raises the same error on every rank instead of a mis-sized gather),
gathers the embeddings and deepstack features in one all-gather, and leaves a tower it wrapped already as it is.
"""

from verl_qwen3vl_plugin.patches.qwen3_vl_vision_dp import replacement
from verl_qwen3vl_plugin.staging import Benchmark, MoveFunctions, Overlap, StagedTest, Staging, WrapAttribute

FILE = "verl/models/transformers/monkey_patch.py"
SCOPE = "apply_monkey_patch"

STAGING = Staging(
    base="verl==0.9.1",
    modules=("model", "fsdp"),
    type="feat",
    description="split Qwen3-VL and Qwen3.5 vision towers over the Ulysses group",
    edits=(
        # The split forward moves in whole, with what it calls ...
        MoveFunctions(
            file=FILE,
            source=replacement,
            names=(
                "assign",
                "_GatherRows",
                "gather_rows",
                "ulysses_group",
                "split_output",
                "_rebuild_output",
                "agree_on_inputs",
                "_warn_fallback",
                "vision_dp_forward",
            ),
            before=SCOPE,
            # The plugin's prefix of its log messages.
            replace=(("verl-qwen3vl-plugin: ", ""),),
        ),
        # ... and wraps each family's vision towers where verl slices their inputs for Ulysses.
        WrapAttribute(
            file=FILE,
            scope=SCOPE,
            after="patch_vlm_for_ulysses_input_slicing(Qwen3VLMoeTextModel)",
            owners=("Qwen3VLVisionModel", "Qwen3VLMoeVisionModel"),
            attribute="forward",
            wrapper="vision_dp_forward",
        ),
        WrapAttribute(
            file=FILE,
            scope=SCOPE,
            after="patch_vlm_for_ulysses_input_slicing(Qwen3_5MoeTextModel)",
            owners=("Qwen3_5VisionModel", "Qwen3_5MoeVisionModel"),
            attribute="forward",
            wrapper="vision_dp_forward",
            note=(
                "The plugin installs `beside_verl_vision_dp`, which steps aside on a tower verl#5230's own vision DP "
                "wrapped; here the split forward itself. verl patches the classes again for each model it builds "
                "(actor and reference): `vision_dp_forward` returns a forward it made as it is."
            ),
        ),
    ),
    tests=(
        StagedTest(
            path="tests/models/test_qwen3_vl_vision_dp_on_cpu.py",
            source="tests/patches/qwen3_vl_vision_dp/staged_qwen3_vl_vision_dp.py",
        ),
    ),
    order=80,
    benchmark=Benchmark(
        section="Vision DP over the Ulysses group (`qwen3_vl_vision_dp`)",
        command="nox -s bench_vision_dp",
    ),
    overlaps=(
        Overlap(
            pr="verl#5230",
            state="stale",
            advice=(
                "no commits since 2026-03, and it conflicts with main, which deleted the legacy fsdp_workers.py it "
                "wires into (the FSDP engine never passes its flag). Comment there first: a rank with no image skips "
                "the FSDP-wrapped tower its peers enter (a collective mismatch), transformers 5's tower output is no "
                "tuple, Qwen3-VL-MoE's tower is a class of its own, its CPU test imports a name the module lacks, and "
                "it drops the eager vision attention under SP even with the flag off. Send this one as its "
                "successor, crediting its design, if the author does not answer."
            ),
        ),
    ),
)
