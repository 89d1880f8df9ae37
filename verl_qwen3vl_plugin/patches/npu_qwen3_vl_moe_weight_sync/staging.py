"""``npu_qwen3_vl_moe_weight_sync`` as a verl pull request: read by ``scripts/upstream.py``.

**This pull request** fixes the full weight sync (``get_per_tensor_param``, which every rollout's sync and the
checkpoint engines' ``send_weights`` read). The shard export the delta checkpoint engine uses
(``get_per_tensor_param_shard``) still sends the NPU experts' packed tensors as stored: a flat shard cannot be
transposed where it is cut.
"""

from verl_qwen3vl_plugin.patches.npu_qwen3_vl_moe_weight_sync import replacement
from verl_qwen3vl_plugin.patches.npu_qwen3_vl_moe_weight_sync.spec import FUNCTION
from verl_qwen3vl_plugin.staging import Decorate, MoveFunctions, StagedTest, Staging

UTILS = "verl/workers/engine/fsdp/utils.py"

STAGING = Staging(
    base="verl==0.9.1",
    modules=("fsdp", "hardware"),
    type="fix",
    description="unfuse NPU Qwen3-VL-MoE experts by their own layout in weight sync",
    edits=(
        # The layout adapter moves in whole, with the names of the modules and the class it looks up ...
        MoveFunctions(
            file=UTILS,
            source=replacement,
            names=("experts_to_transformers5_layout", "npu_block_in_use", "layout_aware"),
            before=FUNCTION,
            # The plugin speaks of verl from outside; in verl's module the split is its own.
            replace=(("verl's ``unfuse_moe_params``", "``unfuse_moe_params``"), ("from verl's own", "from its own")),
        ),
        # ... and wraps the split where it is defined: the FSDP engine imports that name, as the plugin wraps both.
        Decorate(
            file=UTILS,
            functions=(FUNCTION,),
            decorator="layout_aware",
            note=(
                "The plugin wraps `unfuse_moe_params` in `utils` and the name `transformer_impl` bound at its import; "
                "decorated where it is defined, every caller gets it."
            ),
        ),
    ),
    tests=(
        StagedTest(
            path="tests/workers/engine/test_fsdp_engine_npu_qwen3_vl_moe_weights_on_cpu.py",
            source="tests/patches/npu_qwen3_vl_moe_weight_sync/staged_fsdp_engine_npu_qwen3_vl_moe_weights.py",
        ),
    ),
    order=57,
)
