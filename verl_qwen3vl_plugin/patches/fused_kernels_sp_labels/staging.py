"""``fused_kernels_sp_labels`` as a verl pull request: read by ``scripts/upstream.py``."""

from verl_qwen3vl_plugin.patches.fused_kernels_sp_labels import replacement
from verl_qwen3vl_plugin.patches.fused_kernels_sp_labels.spec import FORWARDS
from verl_qwen3vl_plugin.staging import Decorate, MoveFunctions, Overlap, StagedTest, Staging

FILE = "verl/models/transformers/qwen3_vl.py"

STAGING = Staging(
    base="verl==0.7.1",
    modules=("model",),
    type="fix",
    description="score fused-kernel log-probs against the SP shard's labels under Ulysses",
    edits=(
        # The replacement module's two functions move in whole, ahead of the forwards they wrap ...
        MoveFunctions(
            file=FILE, source=replacement, names=("this_shards_labels", "scoring_this_shard"), before=FORWARDS[0]
        ),
        # ... and wrap them where they are defined, as the plugin wraps them at import.
        Decorate(file=FILE, functions=FORWARDS, decorator="scoring_this_shard"),
    ),
    tests=(
        StagedTest(
            path="tests/models/test_qwen3_vl_fused_forward_ulysses_labels_on_cpu.py",
            source="tests/patches/fused_kernels_sp_labels/staged_qwen3_vl_fused_forward_ulysses_labels.py",
        ),
    ),
    order=30,
    backport_of="release/v0.7.1",
    fixed_on_main_by=("verl#6268",),
    overlaps=(
        Overlap(
            pr="verl#5227",
            state="stale",
            advice=(
                "superseded on main by verl#6268; its dense_common change would slice text-only models' labels twice "
                "(the legacy actor has sliced their input_ids already). Suggest closing it; this backport is the "
                "Qwen3-VL part for the 0.7 release branch, which lacks verl#6268."
            ),
        ),
    ),
)
