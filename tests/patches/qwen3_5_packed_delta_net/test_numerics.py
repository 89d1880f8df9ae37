"""Qwen3.5's gated delta-net layers on verl's packed micro-batches (``qwen3_5_packed_delta_net``).

The kernels against transformers' own torch fallback run one sample at a time; a tiny Qwen3.5 and Qwen3.5-MoE with
images through verl's ``apply_monkey_patch`` and its FSDP engine's ``forward_step``, packed, against each sample alone
with the upstream layers; the patch off, the same comparison shows the mixing where upstream has it. SP = 2 against
SP = 1 on two gloo ranks: ``tests/patches/qwen3_vl_vision_dp/test_ulysses.py`` (its Qwen3.5 has delta-net layers)
and the negative control here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import QWEN3_5_SHIPPED, QWEN3_5_TRAINED, TRANSFORMERS, VERL, child_json
from verl_qwen3vl_plugin.patches.qwen3_5_packed_delta_net import delta_net_varlen as varlen
from verl_qwen3vl_plugin.patches.qwen3_5_packed_delta_net import replacement as packed
from verl_qwen3vl_plugin.patches.qwen3_5_packed_delta_net import selftest

HERE = Path(__file__).parent  # this patch's child scripts

needs_tf = pytest.mark.skipif(not QWEN3_5_SHIPPED, reason="transformers' Qwen3.5 (>= 5.2)")
needs_verl = pytest.mark.skipif(not QWEN3_5_TRAINED, reason="Qwen3.5 needs verl >= 0.8 and transformers >= 5.2")
LENGTHS = [37, 90, 1, 64, 20, 130, 0, 65]  # under, at and over one 64-token chunk, a single token, an empty sample


def inputs(lengths, dtype=torch.float32, heads=4, dk=16, dv=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).requires_grad_()

    g = (-torch.rand(1, total, heads, generator=generator)).requires_grad_()  # log decays: <= 0, as the layer's
    beta = torch.rand(1, total, heads, generator=generator).to(dtype).requires_grad_()
    return randn(1, total, heads, dk), randn(1, total, heads, dk), randn(1, total, heads, dv), g, beta


def alone(rule, lengths, q, k, v, g, beta):
    out, start = [], 0
    for n in lengths:
        s = slice(start, start + n)
        start += n
        if n:
            out.append(rule(q[:, s], k[:, s], v[:, s], g=g[:, s], beta=beta[:, s], use_qk_l2norm_in_kernel=True)[0])
    return torch.cat(out, dim=1)


@needs_tf
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rule_equals_each_sample_alone_through_transformers_fallback(dtype, atol):
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    args = inputs(LENGTHS, dtype)
    ours = varlen.chunk_gated_delta_rule(*args, varlen.Layout(LENGTHS, torch.device("cpu")))
    reference = alone(torch_chunk_gated_delta_rule, LENGTHS, *args)
    assert ours.dtype == dtype
    assert (ours.float() - reference.float()).abs().max() <= atol
    weights = torch.randn(reference.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((ours.float() * weights).sum(), args)
    expected = torch.autograd.grad((reference.float() * weights).sum(), args)
    for ours_grad, reference_grad in zip(grads, expected, strict=True):
        scale = reference_grad.float().abs().max()
        assert (ours_grad.float() - reference_grad.float()).abs().max() <= atol * max(1.0, float(scale))
    whole = torch_chunk_gated_delta_rule(*args[:3], g=args[3], beta=args[4], use_qk_l2norm_in_kernel=True)[0]
    assert (whole.float() - reference.float()).abs().max() > 5 * atol, "the unsplit row must show the mixing"


@pytest.mark.parametrize("n", [64, 7])
def test_unit_lower_inverse_is_lapacks(n):
    """The matmul-only inverse (every device, Ascend included) against LAPACK's triangular solve."""
    generator = torch.Generator().manual_seed(2)
    lower = torch.randn(3, 2, n, n, generator=generator, dtype=torch.float64).tril(-1) * 0.3
    eye = torch.eye(n, dtype=torch.float64)
    expected = torch.linalg.solve_triangular(lower + eye, eye.expand_as(lower), upper=False, unitriangular=True)
    assert torch.allclose(varlen._unit_lower_inverse(lower), expected, rtol=1e-10, atol=1e-10)


def test_conv_restarts_at_each_sample():
    generator = torch.Generator().manual_seed(3)
    lengths = [5, 1, 9, 0, 3]
    x = torch.randn(1, 6, sum(lengths), generator=generator)
    conv = torch.nn.Conv1d(6, 6, 4, groups=6, padding=3, bias=True)
    ours = varlen.causal_conv1d(x, conv.weight, conv.bias, varlen.Layout(lengths, torch.device("cpu")))
    pieces, start = [], 0
    for n in lengths:
        pieces.append(F.silu(conv(x[..., start : start + n])[..., :n]) if n else x[..., :0])
        start += n
    assert torch.allclose(ours, torch.cat(pieces, dim=-1), atol=1e-6)


@pytest.mark.parametrize(
    "bounds, problem",
    [([1, 4], "start at 0"), ([0, 5, 3], "never decrease")],
)
def test_bad_boundaries_are_named(bounds, problem):
    with pytest.raises(ValueError, match=problem):
        varlen.lengths_of(torch.tensor(bounds))


@needs_tf
def test_heads_not_divisible_by_sp_raise_before_any_collective(monkeypatch):
    from verl_qwen3vl_plugin.selftest.tiny_models import tiny_qwen3_5

    layer = tiny_qwen3_5().model.language_model.layers[0].linear_attn
    monkeypatch.setattr(packed, "_sequence_parallel", lambda: (3, None))  # no group: a collective would fail
    with pytest.raises(ValueError, match=r"SP size 3 must divide .* \(2 key, 2 value\)"):
        packed.packed_delta_net(layer, torch.zeros(1, 4, 32), torch.tensor([0, 2, 12]))


@needs_tf
@pytest.mark.skipif(
    TRANSFORMERS.release >= (5, 16),
    reason="the layer has no kernel attributes from transformers 5.16; qwen3_5_layer_attributes restores them",
)
def test_fla_kernel_is_given_the_boundaries(monkeypatch):
    """verl 0.8 on CUDA with FLA: the layer's FLA kernel gets every sample's bounds (and the SP pad's)."""
    from verl_qwen3vl_plugin.selftest.tiny_models import tiny_qwen3_5

    seen = {}

    def fla_rule(q, k, v, g, beta, cu_seqlens, **kwargs):
        seen["cu_seqlens"] = cu_seqlens.tolist()
        return varlen.chunk_gated_delta_rule(
            q, k, v, g, beta, varlen.Layout(varlen.lengths_of(cu_seqlens), q.device)
        ), None

    fla_rule.__module__ = "fla.ops.gated_delta_rule.chunk"
    layer = tiny_qwen3_5().model.language_model.layers[0].linear_attn
    hidden = torch.randn(1, 12, 32, generator=torch.Generator().manual_seed(4))
    reference = packed.packed_delta_net(layer, hidden, torch.tensor([0, 2, 10]))
    layer.chunk_gated_delta_rule = fla_rule
    assert packed.uses_fla(layer)  # the verl 0.8 forward hands packed_delta_net packed.fla_rule(layer) then
    found = packed.packed_delta_net(layer, hidden, torch.tensor([0, 2, 10]), rule=packed.fla_rule(layer))
    assert torch.allclose(found, reference, atol=1e-6)
    assert seen["cu_seqlens"] == [0, 2, 10, 12]


# Where upstream mixes packed samples (the patch off): verl 0.8 always, verl 0.9 on transformers >= 5.9 (its fallback
# ignores cu_seqlens); verl 0.9 on <= 5.8 loops over samples, right. Measured: 0.15 / 0.47 (Qwen3.5), 0.09 / 0.21 (MoE).
UPSTREAM_MIXES = QWEN3_5_TRAINED and (VERL.release[:2] == (0, 8) or TRANSFORMERS.release >= (5, 9))


@pytest.fixture(scope="module")
def through_verl() -> dict:
    return child_json(HERE / "packed_delta_net.py", timeout=900)


@pytest.fixture(scope="module")
def ascend_path() -> dict:
    return child_json(HERE / "packed_delta_net.py", "npu", timeout=900)


@needs_verl
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_packed_micro_batch_equals_each_sample_alone(through_verl, kind):
    found, off = through_verl[kind]["on"], through_verl[kind]["off"]
    assert min(found["lengths"]) < varlen.CHUNK < max(found["lengths"]) - varlen.CHUNK, found
    assert found["log_prob_diff"] <= selftest.LOG_PROB_ATOL and found["grad_rel_diff"] <= selftest.GRAD_RTOL, found
    if UPSTREAM_MIXES:
        assert off["log_prob_diff"] > 1e-2 and off["grad_rel_diff"] > 1e-1, off
    else:
        assert off["log_prob_diff"] <= selftest.LOG_PROB_ATOL, off


@needs_verl
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_ascend_path_on_reference_ops_equals_each_sample_alone(ascend_path, kind):
    """What Ascend runs: transformers' fallback (never FLA off CUDA) under verl's NPU norms, rotary embedding and
    experts, on the package's CPU reference torch_npu ops."""
    found = ascend_path
    assert found["npu_norm"] == "verl.models.transformers.npu_patch", found
    on, off = found[kind]["on"], found[kind]["off"]
    assert on["log_prob_diff"] <= selftest.LOG_PROB_ATOL and on["grad_rel_diff"] <= selftest.GRAD_RTOL, on
    if UPSTREAM_MIXES:
        assert off["log_prob_diff"] > 1e-2, off


@needs_verl
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_packing_order_does_not_matter(through_verl, kind):
    """Dynamic batching regroups samples: a sample's log-probs must not depend on its neighbours."""
    assert through_verl[kind]["order_diff"] <= selftest.LOG_PROB_ATOL, through_verl[kind]


@needs_verl
def test_without_the_patch_sp2_is_wrong_or_refused():
    """The negative control of SP = 2: verl 0.8 starts each rank's recurrence from zero; verl 0.9 without FLA needs
    FLA's context-parallel kernel."""
    results = child_json(
        "ulysses_actor.py", "qwen3_5", "mixed", "none",
        env={"VERL_QWEN3VL_PLUGIN_DISABLE": "qwen3_5_packed_delta_net"}, timeout=900,
    )  # fmt: skip
    for r in results:
        if VERL.release >= (0, 9):
            assert "fla" in r.get("error", "") or "FLA" in r.get("error", ""), r
        else:
            assert r["mixed"]["log_prob_diff"] > 1e-3, r
