"""``qwen3_5_layer_attributes``: the probe on transformers' Qwen3.5 layer classes in each release's shape (written
here in a few lines each: the installed stack has one of them) and its near misses; then verl's own layer forwards on
a tiny Qwen3.5 in a child process, with the patch and without. On transformers >= 5.13 (the ``forward`` nox session)
the child without the patch dies of the AttributeError users report."""

from __future__ import annotations

import pytest

from tests.helpers import TRANSFORMERS, VERL, decide_text, last_json, run_args, use_sources
from tests.source_edits import NearMisses, Variant, append, check_near_miss, near_miss_cases, substitute
from verl_qwen3vl_plugin.families import QWEN3_5, QWEN3_5_MOE
from verl_qwen3vl_plugin.patches import spec
from verl_qwen3vl_plugin.patches.qwen3_5_layer_attributes.replacement import dispatched_kernel
from verl_qwen3vl_plugin.registry import DISABLE_ENV, Verdict

PATCH = spec("qwen3_5_layer_attributes")
TARGET = PATCH.target(QWEN3_5.modeling)
VERL_0_9 = "class Qwen3_5GatedDeltaNet:\n    pass\n" + "\n".join(
    f"def {name}(self):\n    return self.{attr}\n"
    for name, attr in (("decoder", "layer_type"), ("conv", "causal_conv1d_fn"), ("rule", "chunk_gated_delta_rule"))
)
KERNELS_ON_LAYER = """
        self.causal_conv1d_fn = causal_conv1d_fn
        self.chunk_gated_delta_rule = chunk_gated_delta_rule or torch_chunk_gated_delta_rule"""
DISPATCHED = """
@use_kernel_func_from_hub_with_fallback("{name}", "fla")
def {function}(x, **kwargs):
    return x
"""


def transformers_source(decoder: str = "layer_type", kernels_on_layer: bool = True, dispatcher: str = "") -> str:
    """transformers' Qwen3.5 classes as far as the probe reads them: <= 5.12 by default; ``decoder="block_type"``
    5.13 to 5.15; with ``kernels_on_layer=False`` and ``dispatcher`` the decorator, 5.16 on."""
    functions = "".join(
        DISPATCHED.format(name=name, function=function).replace("use_kernel_func_from_hub_with_fallback", dispatcher)
        for name, function in (("causal_conv1d_fn", "causal_conv1d_fn"), ("chunk", "torch_chunk_gated_delta_rule"))
    )
    return f"""{functions if dispatcher else ""}
class Qwen3_5GatedDeltaNet(nn.Module):
    def __init__(self, config, layer_idx):
        self.layer_type = config.layer_types[layer_idx]{KERNELS_ON_LAYER if kernels_on_layer else ""}

class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        self.{decoder} = config.layer_types[layer_idx]
"""


SHAPES = {
    "tf5.12": (transformers_source(), Verdict.FIXED_UPSTREAM, "layers-set-what-verl-reads"),
    "tf5.13": (transformers_source("block_type"), Verdict.APPLY, "tf5.13-block-type"),
    "tf5.16": (
        transformers_source("block_type", False, "use_kernel_func_from_hub_with_fallback"),
        Verdict.APPLY,
        "tf5.16-module-kernels",
    ),
    "decoder sets neither name": (transformers_source("kind"), Verdict.UNRECOGNIZED, None),
    "kernels gone, no dispatcher": (
        transformers_source("block_type", False),
        Verdict.UNRECOGNIZED,
        None,
    ),
    "kernels behind another decorator": (
        transformers_source("block_type", False, "use_kernel_forward_from_hub"),
        Verdict.UNRECOGNIZED,
        None,
    ),
}


MODELING = (QWEN3_5.modeling, QWEN3_5_MOE.modeling)
NEAR_MISSES = [
    *(
        NearMisses(
            PATCH.name,
            modeling,
            "layers-set-what-verl-reads",
            (
                Variant(
                    "the decoder layer keeps its type under a third name",
                    modeling,
                    substitute(r"self\.layer_type = config", "self.kind = config"),
                ),
                Variant(
                    "the delta-net keeps its chunked rule under another name, with no dispatcher",
                    modeling,
                    substitute(r"self\.chunk_gated_delta_rule = ", "self.chunk_rule = "),
                ),
            ),
        )
        for modeling in MODELING
    ),
    *(
        NearMisses(
            PATCH.name,
            modeling,
            "verl0.8-no-layer-forwards",
            (
                Variant(
                    "verl adds a decoder-layer forward that reads another attribute",
                    QWEN3_5.verl_forward,
                    append("def qwen3_5_decoder_layer_forward(self, hidden_states):\n    return self.kind\n"),
                ),
                Variant(
                    "verl's model forward is renamed",
                    QWEN3_5.verl_forward,
                    substitute(r"\bdef qwen3_5_base_forward\b", "def qwen3_5_model_forward"),
                ),
            ),
        )
        for modeling in MODELING
    ),
]


@pytest.mark.parametrize(("patch", "target", "variant"), near_miss_cases(NEAR_MISSES))
def test_near_miss_of_a_safe_shape_is_not_called_safe(monkeypatch, patch, target, variant):
    check_near_miss(monkeypatch, patch, target, variant)


@pytest.mark.parametrize("name", SHAPES)
def test_each_shape_gets_its_verdict(monkeypatch, name):
    source, verdict, shape = SHAPES[name]
    use_sources(monkeypatch, {QWEN3_5.verl_forward: VERL_0_9})
    decision = decide_text(PATCH, TARGET, source)
    assert (decision.verdict, decision.shape if shape else None) == (verdict, shape), decision


def verl_source(block_type: str = "block_type", kernel: str = "causal_conv1d_fn", resolver: str = "_delta_net_kernel"):
    """verl's Qwen3.5 module as far as the probe reads it, in verl#7471's shape by default: the layer type and the
    kernels looked up by name."""
    return f"""
def qwen3_5_base_forward(self, input_ids):
    return input_ids

def qwen3_5_decoder_layer_forward(self, hidden_states):
    block_type = getattr(self, "{block_type}", None)
    if block_type is None:
        block_type = getattr(self, "layer_type", None)
    return hidden_states

def qwen3_5_gated_delta_net_forward(self, hidden_states):
    return {resolver}(self, "{kernel}")(hidden_states)
"""


# verl's module as this patch's pull request leaves it: every attribute read through the replacement's reader.
STAGED = """
def qwen3_5_base_forward(self, input_ids):
    return input_ids

def qwen3_5_decoder_layer_forward(self, hidden_states):
    if layer_attribute(self, "layer_type") == "linear_attention":
        return hidden_states

def qwen3_5_gated_delta_net_forward(self, hidden_states):
    return layer_attribute(self, "causal_conv1d_fn")(hidden_states)
"""
VERL_SHAPES = {
    "verl 0.8: a model forward, no layer forwards": (
        "def qwen3_5_base_forward(self, input_ids):\n    return input_ids\n",
        Verdict.NOT_USED,
        "verl0.8-no-layer-forwards",
    ),
    "verl#7471: names looked up": (verl_source(), Verdict.FIXED_UPSTREAM, "verl-resolves-layer-names"),
    "this patch's pull request: read through layer_attribute": (
        STAGED,
        Verdict.FIXED_UPSTREAM,
        "verl-resolves-layer-names",
    ),
    "near miss: the old layer type looked up by getattr": (
        STAGED.replace('layer_attribute(self, "layer_type")', 'getattr(self, "layer_type")'),
        Verdict.UNRECOGNIZED,
        None,
    ),
    "near miss: the layer type under a third name": (
        verl_source(block_type="kind"),
        Verdict.UNRECOGNIZED,
        None,
    ),
    "near miss: the kernels looked up by no known name": (
        verl_source(kernel="conv"),
        Verdict.UNRECOGNIZED,
        None,
    ),
    "near miss: kernels from elsewhere": (
        verl_source(resolver="fla_kernel").replace("(self, ", "("),
        Verdict.UNRECOGNIZED,
        None,
    ),
    "near miss: a layer forward reading another attribute": (
        "def qwen3_5_decoder_layer_forward(self):\n    return self.kind\n",
        Verdict.UNRECOGNIZED,
        None,
    ),
    "near miss: no Qwen3.5 forward at all": ("x = 1\n", Verdict.UNRECOGNIZED, None),
}


@pytest.mark.parametrize("name", VERL_SHAPES)
def test_each_verl_shape_that_reads_no_old_name_gets_its_verdict(monkeypatch, name):
    """On transformers 5.16's classes, whatever verl reads is judged by verl's own shape."""
    source, verdict, shape = VERL_SHAPES[name]
    use_sources(monkeypatch, {QWEN3_5.verl_forward: source})
    decision = decide_text(
        PATCH, TARGET, transformers_source("block_type", False, "use_kernel_func_from_hub_with_fallback")
    )
    assert (decision.verdict, decision.shape if shape else None) == (verdict, shape), decision


def test_a_function_that_dispatches_nothing_is_refused():
    with pytest.raises(RuntimeError, match="not transformers' kernel dispatcher"):
        dispatched_kernel(transformers_source)


@pytest.mark.skipif(VERL.release < (0, 9) or TRANSFORMERS.release < (5, 2), reason="verl 0.9's Qwen3.5 forwards")
@pytest.mark.parametrize("patched", [True, False])
def test_verl_layer_forwards_equal_transformers(patched):
    proc = run_args(
        ["-m", "verl_qwen3vl_plugin.patches.qwen3_5_layer_attributes.selftest"],
        env={} if patched else {DISABLE_ENV: PATCH.name},
    )
    checks = last_json(proc)
    assert len(checks) == 2, proc.stderr
    if patched or TRANSFORMERS.release < (5, 13):
        assert all(ok for _, ok, _ in checks), checks
    else:
        assert not any(ok for _, ok, _ in checks) and all("AttributeError" in detail for *_, detail in checks), checks
