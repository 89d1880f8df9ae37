"""The plugin's grouped Qwen3-VL-MoE experts against transformers 4.57's own forward, measured in the same process:
its training loop (train) and its dense all-experts path (eval), holding the same weights and routing. Both of the
plugin's paths run here: ``torch._grouped_mm`` and the per-expert fallback (forced)."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe

from tests.helpers import decide_text, source_text
from verl_qwen3vl_plugin import originals
from verl_qwen3vl_plugin.patches.qwen3_vl_moe_sparse_experts.replacement import sparse_experts_forward
from verl_qwen3vl_plugin.patches.qwen3_vl_moe_sparse_experts.selftest import (
    BF16_TOLERANCE,
    FP32_TOLERANCE,
    close_check,
    experts_run,
    routed_inputs,
    same_bits_check,
    tiny_experts,
)
from verl_qwen3vl_plugin.patches.qwen3_vl_moe_sparse_experts.spec import PATCH
from verl_qwen3vl_plugin.registry import Verdict

MODULE = modeling_qwen3_vl_moe.__name__
VERDICT = decide_text(PATCH, PATCH.target(MODULE), source_text(MODULE)).verdict
pytestmark = pytest.mark.skipif(VERDICT is not Verdict.APPLY, reason="transformers 5's experts are sparse already")
UPSTREAM = originals.original(modeling_qwen3_vl_moe.Qwen3VLMoeTextExperts, "forward")
PATHS = {
    "grouped_mm": functools.partial(sparse_experts_forward, use_grouped_mm=True),
    "fallback": functools.partial(sparse_experts_forward, use_grouped_mm=False),
}
CASES = {
    "e8_top2": dict(num_experts=8, num_experts_per_tok=2),
    "e4_top4": dict(num_experts=4, num_experts_per_tok=4),  # every token in every expert
    "e16_top2_few_tokens": dict(num_experts=16, num_experts_per_tok=2),  # experts without tokens
    "e8_top4": dict(num_experts=8, num_experts_per_tok=4),  # where transformers' two bf16 paths round apart
}
TOKENS = {"e8_top2": 37, "e4_top4": 11, "e16_top2_few_tokens": 3, "e8_top4": 64}


def setup(case: str, dtype: torch.dtype = torch.float32):
    experts, config = tiny_experts(**CASES[case])
    inputs = routed_inputs(config, tokens=TOKENS[case])
    return experts.to(dtype), tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)


@pytest.mark.parametrize("training", [True, False], ids=["train_vs_loop", "eval_vs_dense"])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers_fp32(path, case, training):
    """Training against transformers' loop, eval against its dense all-experts path."""
    experts, inputs = setup(case)
    check = close_check("fp32", experts_run(experts, PATHS[path], inputs, training),
                        experts_run(experts, UPSTREAM, inputs, training), FP32_TOLERANCE)  # fmt: skip
    assert check.ok, check.detail


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path", list(PATHS))
def test_eval_output_bit_identical_to_training_output(path, dtype):
    experts, inputs = setup("e8_top4", dtype)
    check = same_bits_check("modes", experts_run(experts, PATHS[path], inputs, False),
                            experts_run(experts, PATHS[path], inputs, True))  # fmt: skip
    assert check.ok, check.detail


def test_upstream_modes_differ_the_control():
    """transformers' own eval and training paths do not agree bit for bit: what the plugin's equality fixes."""
    experts, inputs = setup("e8_top4", torch.bfloat16)
    check = same_bits_check("modes", experts_run(experts, UPSTREAM, inputs, False),
                            experts_run(experts, UPSTREAM, inputs, True))  # fmt: skip
    assert not check.ok


@pytest.mark.parametrize("path", list(PATHS))
def test_bf16_against_fp32_reference(path):
    """bf16 within BF16_TOLERANCE of transformers' fp32 loop, relative to the largest reference entry."""
    experts, inputs = setup("e8_top2")
    reference = experts_run(experts, UPSTREAM, inputs, True)
    experts, inputs = setup("e8_top2", torch.bfloat16)
    check = close_check("bf16", experts_run(experts, PATHS[path], inputs, True), reference, BF16_TOLERANCE)
    assert check.ok, check.detail


def test_grouped_mm_and_fallback_agree():
    experts, inputs = setup("e16_top2_few_tokens")
    runs = [experts_run(experts, PATHS[p], inputs, True) for p in PATHS]
    check = close_check("paths", runs[0], runs[1], FP32_TOLERANCE)
    assert check.ok, check.detail


def test_parameters_keep_their_layout_and_every_gradient_flows():
    experts, inputs = setup("e16_top2_few_tokens")
    shapes = {n: p.shape for n, p in experts.named_parameters()}
    run = experts_run(experts, sparse_experts_forward, inputs, True)
    assert {n: p.shape for n, p in experts.named_parameters()} == shapes
    assert all(g is not None and g.shape == (shapes.get(n) or g.shape) for n, g in run.grads.items())
    assert all(float(g.abs().sum()) > 0 for g in run.grads.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("path", list(PATHS))
def test_experts_without_tokens_get_exactly_zero_gradient(path, training, dtype):
    """3 tokens over 16 experts: most get none, routinely so at 128 experts and small micro-batches
    (pytorch#172439 is a grouped GEMM whose backward gives them a gradient anyway)."""
    experts, inputs = setup("e16_top2_few_tokens", dtype)
    empty = sorted(set(range(experts.num_experts)) - set(inputs[2].flatten().tolist()))
    assert len(empty) >= 10
    run = experts_run(experts, PATHS[path], inputs, training)
    for name in ("gate_up_proj", "down_proj"):
        assert torch.count_nonzero(run.grads[name][empty]) == 0, name
        assert torch.count_nonzero(run.grads[name]) > 0, name
