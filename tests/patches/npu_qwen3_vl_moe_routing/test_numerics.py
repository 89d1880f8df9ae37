"""``npu_qwen3_vl_moe_routing`` on verl's real Ascend ``npu_patch``, run on the CPU through reference ``torch_npu``
ops, without and with the plugin: its Qwen3-VL-MoE block against transformers' own (weights copied with the layout
mapping on transformers 5), and a whole tiny model. Also the NPU group's statuses in that process.

verl's npu_patch rewires transformers' Qwen3 modules for the rest of the process, so this module runs in a pytest
process of its own (marker ``fake_npu``; see noxfile.py). References are computed before verl swaps the block (the
``npu`` fixture, ``tests/npu_fixture.py``).
"""

from __future__ import annotations

import pytest
import torch

from tests.npu_fixture import NPU_PATCH, SHARD_EXPORT, SYNC_ENGINE, SYNC_UTILS, SYNCS, whole_model_loss_and_grads
from verl_qwen3vl_plugin.patches.npu_qwen3_vl_moe_routing import spec as routing
from verl_qwen3vl_plugin.patches.npu_qwen3_vl_moe_weight_sync import spec as sync
from verl_qwen3vl_plugin.registry import Status, Verdict, patch_statuses
from verl_qwen3vl_plugin.selftest.moe_blocks import block_input, block_pair, npu_layout, run_block
from verl_qwen3vl_plugin.selftest.npu_qwen3_vl_moe import block_check
from verl_qwen3vl_plugin.selftest.tiny_models import MOE_TEXT, tiny_qwen3_vl_moe

pytestmark = pytest.mark.fake_npu


def test_statuses_match_the_installed_verl(npu):
    statuses = {(s.patch, s.target): s for s in patch_statuses()}
    status = statuses[routing.PATCH.name, NPU_PATCH]
    if npu.patched:
        assert status.status is Status.APPLIED, status
    else:
        assert (status.status, status.verdict) == (Status.SKIPPED, Verdict.FIXED_UPSTREAM), status
        assert npu.npu_block.forward is npu.verl_forward
    for target in (SYNC_UTILS, SYNC_ENGINE):
        status = statuses[sync.PATCH.name, target.label]
        assert status.status is (Status.APPLIED if SYNCS else Status.SKIPPED), status
    status = statuses[sync.PATCH.name, SHARD_EXPORT.label]
    assert status.status is (Status.UNRECOGNIZED if SYNCS else Status.SKIPPED), status
    for status in statuses.values():  # applied here, yet this machine has no NPU: never run in a real process
        if status.status is Status.APPLIED:
            assert status.dormant == "code for npu devices, and this machine has none", status


def affected(npu):
    if not npu.patched:
        pytest.skip("this verl's NPU block scatters in training; nothing to fix")


def test_bug_without_plugin_index_error_when_experts_outnumber_top_k(npu):
    affected(npu)
    _, block = block_pair(npu.hf_block, npu.npu_block, num_experts=4)
    with pytest.raises(IndexError):
        run_block(block, block_input(), training=True, forward=npu.verl_forward)


def test_bug_without_plugin_wrong_numbers_when_experts_equal_top_k(npu):
    affected(npu)
    hf, block = block_pair(npu.hf_block, npu.npu_block, num_experts=MOE_TEXT["num_experts_per_tok"])
    verl = run_block(block, block_input(), training=True, forward=npu.verl_forward)
    assert not torch.allclose(verl.out, run_block(hf, block_input(), training=True).out, atol=1e-3)


@pytest.mark.parametrize("num_experts", [4, 2], ids=["experts_gt_top_k", "experts_eq_top_k"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_block_matches_transformers_outputs_and_gradients(npu, num_experts, training):
    hf, block = block_pair(npu.hf_block, npu.npu_block, num_experts)
    check = block_check("block", run_block(block, block_input(), training), run_block(hf, block_input(), training))
    assert check.ok, check.detail


def test_whole_model_loss_and_gradients_match_transformers(npu):
    """A tiny Qwen3-VL-MoE built after verl's npu_patch (NPU block, RMSNorm, RoPE) trains like transformers'."""
    model = tiny_qwen3_vl_moe()
    assert type(model.model.language_model.layers[0].mlp) is npu.npu_block
    model.load_state_dict(npu_layout(npu.state))
    loss, grads = whole_model_loss_and_grads(model)
    grads = npu_layout(grads)
    torch.testing.assert_close(loss, npu.ref_loss, rtol=1e-5, atol=1e-5)
    assert grads.keys() == npu.ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, npu.ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
