"""``qwen3_vl_single_vision_call`` as a verl pull request: read by ``scripts/upstream.py``.

**This pull request** replaces ``_get_input_embeds`` where verl defines it, in ``qwen3_vl.py`` and ``qwen3_5.py``
(whose function now takes Qwen3-VL's and keeps its two outputs). The plugin also names a sampled vision placeholder
behind a token-count error (``naming_strays``): that is ``vision_placeholder_ban``'s check, and stays out of this one.
"""

from verl_qwen3vl_plugin.patches.qwen3_vl_single_vision_call import replacement
from verl_qwen3vl_plugin.patches.qwen3_vl_single_vision_call.spec import FUNCTION
from verl_qwen3vl_plugin.patches.qwen3_vl_vision_dp import replacement as vision_dp
from verl_qwen3vl_plugin.staging import Benchmark, MoveFunctions, Overlap, ReplaceFunction, StagedTest, Staging

QWEN3_VL = "verl/models/transformers/qwen3_vl.py"
QWEN3_5 = "verl/models/transformers/qwen3_5.py"

STAGING = Staging(
    base="verl==0.9.1",
    modules=("model",),
    type="fix",
    description="one vision-tower call per micro-batch in Qwen3-VL and Qwen3.5 _get_input_embeds",
    edits=(
        # The helper that reads the tower's output (a tuple or transformers 5's), vision DP's in the plugin ...
        MoveFunctions(file=QWEN3_VL, source=vision_dp, names=("split_output",), before=FUNCTION),
        # ... then the plugin's function, with its helpers, in place of verl's Qwen3-VL one ...
        ReplaceFunction(
            file=QWEN3_VL,
            source=replacement,
            names=("_sequence_order", "_check_counts", "get_input_embeds"),
            replaces=FUNCTION,
            by="get_input_embeds",
        ),
        # ... and Qwen3.5's, which takes Qwen3-VL's and keeps its own two outputs.
        ReplaceFunction(
            file=QWEN3_5,
            source=replacement,
            names=("get_input_embeds_qwen3_5",),
            replaces=FUNCTION,
            by="get_input_embeds_qwen3_5",
            note=(
                "It reads Qwen3-VL's function, imported from `qwen3_vl.py` under the plugin's name for it "
                "(`get_input_embeds`), since the Qwen3.5 module defines a `_get_input_embeds` of its own."
            ),
        ),
    ),
    tests=(
        StagedTest(
            path="tests/models/test_qwen3_vl_single_vision_call_on_cpu.py",
            source="tests/patches/qwen3_vl_single_vision_call/staged_qwen3_vl_single_vision_call.py",
        ),
    ),
    order=65,
    benchmark=Benchmark(
        section="One vision-tower call per micro-batch (`qwen3_vl_single_vision_call`)",
        command="nox -s bench_vision_call",
    ),
    overlaps=(
        Overlap(
            pr="verl#7323",
            state="open",
            advice=(
                "review it first for Qwen3.5: the same one tower call in qwen3_5.py, with a two-rank FSDP2 test of "
                "deferred gradient sync. It leaves qwen3_vl.py alone: once it lands, send this PR without its "
                "qwen3_5.py hunk, for Qwen3-VL and Qwen3-VL-MoE (their deepstack features put back in sequence order "
                "with one index_select), and suggest there its one host sync in place of three .item() calls."
            ),
        ),
    ),
)
