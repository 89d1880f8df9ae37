"""``qwen3_5_packed_delta_net`` as a verl pull request: read by ``scripts/upstream.py``.

**This pull request** covers verl >= 0.9, whose decoder layer hands the gated delta-net the packed row's
``cu_seqlens``: its FLA path is left as it is, and every other packed row (transformers' torch fallback, Ulysses SP
without FLA) runs the torch varlen path. The plugin's verl 0.8 path (boundaries read from the packed position ids) has
no counterpart here. verl#6660 (merged, in 0.9) is the FLA path this keeps; none of the related pull requests covers
the torch path.
"""

from verl_qwen3vl_plugin.patches.qwen3_5_packed_delta_net import delta_net_varlen, replacement
from verl_qwen3vl_plugin.staging import Decorate, MoveFunctions, NewModule, StagedTest, Staging

FILE = "verl/models/transformers/qwen3_5.py"
VARLEN = "verl/models/transformers/gated_delta_net_varlen.py"
FORWARD = "qwen3_5_gated_delta_net_forward"

STAGING = Staging(
    base="verl==0.9.1",
    modules=("model",),
    type="fix",
    description="keep packed Qwen3.5 samples apart in the gated delta-net without FLA, and run it under Ulysses",
    edits=(
        # The plugin's varlen chunked rule and convolution become a module of their own ...
        NewModule(
            file=VARLEN,
            source=delta_net_varlen,
            # In verl's words: the loop it replaces is verl's own.
            replace=(
                (
                    "verl 0.9 keeps them apart with a Python loop over samples on transformers",
                    "verl's own forward keeps them apart, looping over the samples, on transformers",
                ),
            ),
        ),
        # ... the layer's packed path moves in beside verl's delta-net forward ...
        MoveFunctions(
            file=FILE,
            source=replacement,
            names=("_sequence_parallel", "uses_fla", "masked", "_head_channels", "packed_delta_net", "packed_forward"),
            before=FORWARD,
            replace=(("for the plugin's packed gated delta-net", "for the packed gated delta-net"),),
        ),
        # ... and wraps that forward where it is defined, as the plugin wraps the module's name at import.
        Decorate(
            file=FILE,
            functions=(FORWARD,),
            decorator="packed_forward",
            note=(
                "`apply_monkey_patch` imports the decorated function and installs it on both Qwen3.5 gated "
                "delta-net classes, as it installed the undecorated one."
            ),
        ),
    ),
    tests=(
        StagedTest(
            path="tests/models/test_qwen3_5_packed_delta_net_on_cpu.py",
            source="tests/patches/qwen3_5_packed_delta_net/staged_qwen3_5_packed_delta_net.py",
        ),
    ),
    order=75,
)
