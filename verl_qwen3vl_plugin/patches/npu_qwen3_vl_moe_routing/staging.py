"""``npu_qwen3_vl_moe_routing`` as a verl pull request, a backport for the 0.7.x release branch: read by
``scripts/upstream.py``.

**This pull request** is verl#6131's routing fix on its own: the scatter of the top-k weights into the dense routing
matrix, which both expert paths read, runs in training too. The plugin runs it as part of its whole routing
(``moe_routing.dense_routing``, shared with routing replay, which verl 0.7.x does not have for this block).
"""

from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay.moe_routing import dense_routing
from verl_qwen3vl_plugin.staging import StagedTest, Staging, Unguard

STAGING = Staging(
    base="verl==0.7.1",
    modules=("model",),
    type="fix",
    description="scatter NPU Qwen3-VL-MoE routing weights in training",
    edits=(
        Unguard(
            file="verl/models/transformers/npu_patch.py",
            scope="NPUQwen3VLMoeTextSparseMoeBlock.forward",
            test="not self.training",
            source=dense_routing,
            call="scatter_",
            note=(
                "The plugin replaces the block's `forward` with one that routes through `dense_routing` (softmax in "
                "fp32, top-k, renormalise, cast to the logits' dtype, scatter): verl's own steps, so the staged "
                "change is the guard alone, as verl#6131 removed it on main."
            ),
        ),
    ),
    tests=(
        StagedTest(
            path="tests/models/test_npu_qwen3_vl_moe_routing_on_cpu.py",
            source="tests/patches/npu_qwen3_vl_moe_routing/staged_npu_qwen3_vl_moe_routing.py",
        ),
    ),
    order=35,
    backport_of="release/v0.7.1",
    fixed_on_main_by=("verl#6131",),
)
