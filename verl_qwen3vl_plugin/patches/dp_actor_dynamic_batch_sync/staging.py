"""``dp_actor_dynamic_batch_sync`` as a verl pull request: read by ``scripts/upstream.py``."""

from verl_qwen3vl_plugin.patches.dp_actor_dynamic_batch_sync import replacement
from verl_qwen3vl_plugin.patches.dp_actor_dynamic_batch_sync.spec import CALLERS, FUNCTION
from verl_qwen3vl_plugin.staging import Overlap, PassKeyword, StagedTest, Staging
from verl_qwen3vl_plugin.upstream import DP_ACTOR, DP_CRITIC


def _file(module: str) -> str:
    return module.replace(".", "/") + ".py"


STAGING = Staging(
    base="verl==0.7.1",
    modules=("fsdp",),
    type="fix",
    description="agree on the dynamic micro-batch count across ranks in dp_actor and dp_critic",
    edits=tuple(
        # Each caller passes the group the wrapper would give it.
        PassKeyword(
            file=_file(module),
            scopes=tuple(f"{CALLERS[module][0]}.{method}" for method in CALLERS[module][1]),
            call=FUNCTION,
            keyword="dp_group",
            source=replacement.with_default_group,
            note=(
                "The wrapper passes it only once a process group exists; before that `group.WORLD` is None, which "
                "the split reads as no group, so passing it always is the same."
            ),
        )
        for module in (DP_ACTOR, DP_CRITIC)
    ),
    tests=(
        StagedTest(
            path="tests/workers/test_dp_dynamic_bsz_micro_batch_count_on_cpu.py",
            source="tests/patches/dp_actor_dynamic_batch_sync/staged_dp_dynamic_bsz_micro_batch_count.py",
        ),
    ),
    order=20,
    backport_of="release/v0.7.1",
    fixed_on_main_by=("verl#5591",),
    overlaps=(
        Overlap(
            pr="verl#5921",
            state="merged on release/v0.7.1, in no PyPI release",
            advice=(
                "the same fix for dp_actor alone (checked on the branch as of 2026-07-15): dp_critic still splits by "
                "its own count there. Against that branch this PR's dp_actor hunks do not apply; send its dp_critic "
                "half, with the test."
            ),
        ),
    ),
)
