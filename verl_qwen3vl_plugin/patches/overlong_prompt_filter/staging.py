"""``overlong_prompt_filter`` as a verl pull request: read by ``scripts/upstream.py``."""

from verl_qwen3vl_plugin.patches.overlong_prompt_filter import replacement
from verl_qwen3vl_plugin.staging import ChangeArgument, StagedTest, Staging

STAGING = Staging(
    base="verl==0.7.1",
    modules=("data",),
    type="fix",
    description="count vision tokens in the overlong-prompt filter",
    edits=(
        # The filter's doc2len builds messages from what the wrapper hands _build_messages: a deep copy of the row.
        ChangeArgument(
            file="verl/utils/dataset/rl_dataset.py",
            scope="RLHFDataset.maybe_filter_out_long_prompts",
            call="self._build_messages",
            position=0,
            source=replacement._from_a_copy,
            parameter="example",
            note=(
                "The plugin hands the copy through a `_build_messages` it swaps in while the filter runs; in verl the "
                "filter's own call takes it, as verl 0.8 does, and `__getitem__` still builds from the row itself."
            ),
        ),
    ),
    tests=(
        StagedTest(
            path="tests/utils/dataset/test_rl_dataset_overlong_filter_on_cpu.py",
            source="tests/patches/overlong_prompt_filter/staged_rl_dataset_overlong_filter.py",
        ),
    ),
    order=10,
    backport_of="release/v0.7.1",
    fixed_on_main_by=("verl#5004",),
)
