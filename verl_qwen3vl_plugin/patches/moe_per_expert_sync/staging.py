"""``moe_per_expert_sync`` as a verl pull request: read by ``scripts/upstream.py``.

**This pull request** splits the FSDP engine's weight stream, the one source of both the colocated sync
(``update_weights``) and the checkpoint engine's ``send_weights``; verl#6923, on the release branch, splits in
``ServerAdapter.update_weights``, for colocated syncs only.
"""

from verl_qwen3vl_plugin.patches.moe_per_expert_sync import replacement
from verl_qwen3vl_plugin.patches.moe_per_expert_sync.spec import ENGINE, METHOD, layouts
from verl_qwen3vl_plugin.staging import Constant, Decorate, MoveFunctions, StagedTest, Staging

FILE = "verl/workers/engine/fsdp/transformer_impl.py"

STAGING = Staging(
    base="verl==0.8.0",
    modules=("fsdp",),
    type="fix",
    description="send Qwen3-VL-MoE and Qwen3.5-MoE experts to the rollout per expert",
    edits=(
        # The replacement's split moves in whole, with the layouts of the experts classes it knows ...
        MoveFunctions(
            file=FILE,
            source=replacement,
            names=("packed_layout", "_matrix", "per_expert", "per_expert_stream"),
            before=ENGINE,
            # The plugin's wording, made verl's: its errors lose the patch's name and its switch.
            replace=(
                ("moe_per_expert_sync: ", ""),
                (
                    "set VERL_QWEN3VL_PLUGIN_DISABLE=moe_per_expert_sync to send them as stored",
                    "add its layout to EXPERT_LAYOUTS",
                ),
            ),
        ),
        Constant(file=FILE, name="EXPERT_LAYOUTS", value=layouts(), before=ENGINE),
        # ... and wraps the engine's weight stream where it is defined, as the plugin wraps it at import.
        Decorate(
            file=FILE,
            functions=(f"{ENGINE}.{METHOD}",),
            decorator="functools.partial(per_expert_stream, layouts=EXPERT_LAYOUTS)",
            imports=("import functools",),
            note="The plugin passes its `layouts()`, written out above as `EXPERT_LAYOUTS`.",
        ),
    ),
    tests=(
        StagedTest(
            path="tests/workers/engine/test_fsdp_engine_moe_per_expert_weights_on_cpu.py",
            source="tests/patches/moe_per_expert_sync/staged_fsdp_engine_moe_per_expert_weights.py",
        ),
    ),
    order=50,
    backport_of="release/v0.8.0",
    fixed_on_main_by=("verl#6896",),
)
