"""``qwen3_vl_nested_position_ids`` as a verl pull request: read by ``scripts/upstream.py``.

**This pull request** replaces ``maybe_fix_3d_position_ids`` where verl defines it, so every caller gets the rebuild;
the wrapper of ``prepare_micro_batches`` stays in the plugin for verl 0.7, whose split repacks the micro-batches
(verl 0.8 and later keep the index through it).
"""

from verl_qwen3vl_plugin.patches.qwen3_vl_nested_position_ids import replacement
from verl_qwen3vl_plugin.patches.qwen3_vl_nested_position_ids.spec import FUNCTION
from verl_qwen3vl_plugin.staging import Overlap, ReplaceFunction, StagedTest, Staging

STAGING = Staging(
    base="verl==0.9.1",
    modules=("trainer",),
    type="fix",
    description="rebuild rope-packed 3D position_ids in maybe_fix_3d_position_ids",
    edits=(
        # The plugin's function, with the layout check it calls, in place of verl's relabel: every caller gets it.
        ReplaceFunction(
            file="verl/utils/tensordict_utils.py",
            source=replacement,
            names=("sequence_ragged", FUNCTION),
            replaces=FUNCTION,
            # The plugin's docstring, made verl's: it no longer names verl's function.
            replace=((f"verl's ``{FUNCTION}(data)``: the batch's", "The batch's"),),
            note=(
                "The plugin replaces the function where each caller imported it (the engine base, the engine "
                "workers); in verl it is replaced where it is defined."
            ),
        ),
    ),
    tests=(
        StagedTest(
            path="tests/test_protocol_v2_3d_position_ids_on_cpu.py",
            source="tests/patches/qwen3_vl_nested_position_ids/staged_protocol_v2_3d_position_ids.py",
        ),
    ),
    order=70,
    overlaps=(
        Overlap(
            pr="verl#7901",
            state="open",
            advice=(
                "review it first: it fixes where the layout goes wrong (the nested tensors built ragged along the "
                "rope rows, and their serialization) as well as this read side, which alone this PR rebuilds. Offer "
                "this PR's test as regression coverage, and check that its normalizer refuses an unknown layout by "
                "name, as this one does, rather than passing it on (its code was not readable here)."
            ),
        ),
    ),
)
