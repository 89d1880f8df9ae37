"""``npu_qwen3_vl_moe_sparse_eval`` on verl's real Ascend ``npu_patch``, run on the CPU through reference ``torch_npu``
ops: the NPU experts' eval forward is the plugin's grouped one, and it gives verl's dense eval numbers and the
training path's output bit for bit.

verl's npu_patch rewires transformers' Qwen3 modules for the rest of the process, so this module runs in a pytest
process of its own (marker ``fake_npu``; see noxfile.py), with the ``npu`` fixture (``tests/npu_fixture.py``).
"""

from __future__ import annotations

import pytest
import torch

from verl_qwen3vl_plugin.selftest.moe_blocks import block_input, block_pair, run_block
from verl_qwen3vl_plugin.selftest.npu_qwen3_vl_moe import block_check

pytestmark = pytest.mark.fake_npu


def test_experts_eval_is_grouped(npu):
    assert npu.experts.forward is not npu.verl_experts_forward
    assert npu.experts.forward.__wrapped__ is npu.verl_experts_forward


@pytest.mark.parametrize("num_experts", [4, 2], ids=["experts_gt_top_k", "experts_eq_top_k"])
def test_grouped_eval_matches_verl_dense_eval(npu, num_experts, monkeypatch):
    _, block = block_pair(npu.hf_block, npu.npu_block, num_experts)
    grouped = run_block(block, block_input(), training=False)
    monkeypatch.setattr(npu.experts, "forward", npu.verl_experts_forward)
    check = block_check("eval", grouped, run_block(block, block_input(), training=False))
    assert check.ok, check.detail


def test_grouped_eval_output_bit_identical_to_training(npu):
    _, block = block_pair(npu.hf_block, npu.npu_block, num_experts=4)
    evaluation, training = run_block(block, block_input(), False), run_block(block, block_input(), True)
    assert torch.equal(evaluation.out, training.out)
