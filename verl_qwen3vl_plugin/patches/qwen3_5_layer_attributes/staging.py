"""``qwen3_5_layer_attributes`` as a verl pull request: read by ``scripts/upstream.py``.

**This pull request** makes verl's Qwen3.5 layer forwards read each layer attribute through ``layer_attribute``,
which finds it where each transformers release keeps it; the plugin instead puts the attributes a release lacks back
on its classes, as what that same function reads. verl#7471 (open) is the same fix in another form: it resolves the
kernels FLA first, and hides the torch rule's ``**kwargs`` so that verl's per-sample loop runs without FLA.
"""

from verl_qwen3vl_plugin.patches.qwen3_5_layer_attributes import replacement
from verl_qwen3vl_plugin.patches.qwen3_5_layer_attributes.replacement import DELTA_NET_KERNELS, RENAMED_LAYER_ATTRIBUTES
from verl_qwen3vl_plugin.staging import MoveFunctions, Overlap, ReadThrough, StagedTest, Staging

FILE = "verl/models/transformers/qwen3_5.py"

STAGING = Staging(
    base="verl==0.9.1",
    modules=("model",),
    type="fix",
    description="Qwen3.5 layer forwards on transformers >= 5.13 (block_type, module-level delta-net kernels)",
    edits=(
        # The replacement's reader moves in whole, with the names it maps ...
        MoveFunctions(
            file=FILE,
            source=replacement,
            names=("dispatched_kernel", "layer_attribute"),
            before="_packed_chunk_gated_delta_rule",
        ),
        # ... and verl's layer forwards read through it what they read on the layer.
        ReadThrough(
            file=FILE,
            scopes=(
                "_packed_chunk_gated_delta_rule",
                "qwen3_5_gated_delta_net_forward",
                "qwen3_5_decoder_layer_forward",
            ),
            attributes=(*RENAMED_LAYER_ATTRIBUTES, *DELTA_NET_KERNELS),
            reader=replacement.layer_attribute,
            note=(
                "Where a release sets an attribute on the layer (the layer type up to transformers 5.12, the kernels "
                "up to 5.15) it is read as before, so verl's forwards run as they do on its pinned transformers."
            ),
        ),
    ),
    tests=(
        StagedTest(
            path="tests/models/test_qwen3_5_layer_attributes_on_cpu.py",
            source="tests/patches/qwen3_5_layer_attributes/staged_qwen3_5_layer_attributes.py",
        ),
    ),
    order=15,
    stack="verl0.9.1-tf5.22.2",
    overlaps=(
        Overlap(
            pr="verl#7471",
            state="open",
            advice=(
                "review it first: the same fix in another form (kernels resolved FLA first, block_type read with "
                "layer_type as fallback). Read here, not run: its causal_conv1d_fn lookup never returns None, so "
                "without the causal-conv1d package it raises AttributeError on transformers < 5.16, where verl's own "
                "fallback used to run, and hands verl transformers' dispatcher on >= 5.16, which keeps only the torch "
                "function's parameter names. Ask there for this PR's rule (None where transformers would fall back "
                "to its torch function) and a test without causal-conv1d; send this one if it stalls."
            ),
        ),
    ),
)
