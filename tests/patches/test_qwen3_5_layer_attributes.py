"""``qwen3_5_layer_attributes``: the probe on transformers' Qwen3.5 layer classes in each release's shape (written
here in a few lines each: the installed stack has one of them) and its near misses; then verl's own layer forwards on
a tiny Qwen3.5 in a child process, with the patch and without. On transformers >= 5.13 (the ``forward`` nox session)
the child without the patch dies of the AttributeError users report."""

from __future__ import annotations

import pytest

from tests.helpers import TRANSFORMERS, VERL, judge, last_json, run_args, use_sources
from verl_qwen3vl_plugin.families import QWEN3_5
from verl_qwen3vl_plugin.patches import spec
from verl_qwen3vl_plugin.registry import DISABLE_ENV, Verdict
from verl_qwen3vl_plugin.replacements.qwen3_5_layer_attributes import dispatched_kernel

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
    "decoder sets neither name": (transformers_source("kind"), Verdict.UNRECOGNIZED, "unknown-layer-attributes"),
    "kernels gone, no dispatcher": (
        transformers_source("block_type", False),
        Verdict.UNRECOGNIZED,
        "unknown-layer-attributes",
    ),
    "kernels behind another decorator": (
        transformers_source("block_type", False, "use_kernel_forward_from_hub"),
        Verdict.UNRECOGNIZED,
        "unknown-layer-attributes",
    ),
}


@pytest.mark.parametrize("name", SHAPES)
def test_each_shape_gets_its_verdict(monkeypatch, name):
    source, verdict, shape = SHAPES[name]
    use_sources(monkeypatch, {QWEN3_5.verl_forward: VERL_0_9})
    decision = judge(PATCH, TARGET, source)
    assert (decision.verdict, decision.shape) == (verdict, shape), decision


def test_a_verl_reading_none_of_the_names_is_not_judged_by_them(monkeypatch):
    """verl 0.8 installs no layer forwards of its own; a verl reading transformers' new names needs nothing."""
    use_sources(monkeypatch, {QWEN3_5.verl_forward: "def forward(self):\n    return self.block_type\n"})
    decision = judge(PATCH, TARGET, transformers_source("block_type", False, "use_kernel_func_from_hub_with_fallback"))
    assert decision.verdict is Verdict.NOT_USED, decision


def test_a_function_that_dispatches_nothing_is_refused():
    with pytest.raises(RuntimeError, match="not transformers' kernel dispatcher"):
        dispatched_kernel(transformers_source)


@pytest.mark.skipif(VERL.release < (0, 9) or TRANSFORMERS.release < (5, 2), reason="verl 0.9's Qwen3.5 forwards")
@pytest.mark.parametrize("patched", [True, False])
def test_verl_layer_forwards_equal_transformers(patched):
    proc = run_args(
        ["-m", "verl_qwen3vl_plugin.selftest.qwen3_5_layer_attributes"],
        env={} if patched else {DISABLE_ENV: PATCH.name},
    )
    checks = last_json(proc)
    assert len(checks) == 2, proc.stderr
    if patched or TRANSFORMERS.release < (5, 13):
        assert all(ok for _, ok, _ in checks), checks
    else:
        assert not any(ok for _, ok, _ in checks) and all("AttributeError" in detail for *_, detail in checks), checks
