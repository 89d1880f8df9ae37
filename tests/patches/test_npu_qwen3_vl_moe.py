"""verl's real Ascend ``npu_patch`` run on the CPU through reference ``torch_npu`` ops, without and with the plugin.

verl's npu_patch rewires transformers' Qwen3 modules for the rest of the process, so this module runs in its own
pytest process (marker ``fake_npu``; see noxfile.py). References are computed before it is imported.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import TRANSFORMERS
from verl_qwen3vl_plugin.registry import NPU, Status, install_group, patch_statuses
from verl_qwen3vl_plugin.selftest.moe_blocks import block_input, block_pair, run_block
from verl_qwen3vl_plugin.selftest.npu_reference import fake_torch_npu
from verl_qwen3vl_plugin.selftest.npu_routing import block_check
from verl_qwen3vl_plugin.selftest.tiny_models import MOE_TEXT, randomize, tiny_qwen3_vl_moe

# verl's NPU block keeps transformers 4.57's expert layout, (experts, hidden, 2 * intermediate); transformers 5 stores
# (experts, 2 * intermediate, hidden), so weights only carry over, and numbers only compare, on transformers 4.x.
SAME_LAYOUT = TRANSFORMERS.release < (5,)
same_layout = pytest.mark.skipif(not SAME_LAYOUT, reason="verl's NPU block and transformers 5 differ in expert layout")
pytestmark = pytest.mark.fake_npu


def whole_model_loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = torch.arange(1, 13).remainder(MOE_TEXT["vocab_size"]).unsqueeze(0)
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def npu():
    with fake_torch_npu():
        from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as hf

        hf_block = hf.Qwen3VLMoeTextSparseMoeBlock
        reference = randomize(tiny_qwen3_vl_moe(), seed=0)
        ref_loss, ref_grads = whole_model_loss_and_grads(reference)
        npu_patch = importlib.import_module("verl.models.transformers.npu_patch")
        block = npu_patch.NPUQwen3VLMoeTextSparseMoeBlock
        verl_forward = block.forward
        install_group(NPU)  # npu_patch is already imported: the hook acts right away
        yield SimpleNamespace(
            hf_block=hf_block,
            npu_block=block,
            verl_forward=verl_forward,
            patched=block.forward is not verl_forward,
            state=reference.state_dict(),
            ref_loss=ref_loss,
            ref_grads=ref_grads,
        )


def test_status_matches_the_installed_verl(npu):
    (status,) = [s for s in patch_statuses() if s.patch == "npu_qwen3_vl_moe_routing"]
    if npu.patched:
        assert status.status is Status.APPLIED, status
    else:
        assert status.status is Status.SKIPPED and status.verdict == "fixed_upstream", status
        assert npu.npu_block.forward is npu.verl_forward


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


@same_layout
@pytest.mark.parametrize("num_experts", [4, 2])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_block_matches_transformers_outputs_and_gradients(npu, num_experts, training):
    hf, block = block_pair(npu.hf_block, npu.npu_block, num_experts)
    check = block_check("block", run_block(block, block_input(), training), run_block(hf, block_input(), training))
    assert check.ok, check.detail


@same_layout
def test_whole_model_loss_and_gradients_match_transformers(npu):
    """A tiny Qwen3-VL-MoE built after verl's npu_patch (NPU block, RMSNorm, RoPE) trains like transformers'."""
    model = tiny_qwen3_vl_moe()
    assert type(model.model.language_model.layers[0].mlp) is npu.npu_block
    model.load_state_dict(npu.state)
    loss, grads = whole_model_loss_and_grads(model)
    torch.testing.assert_close(loss, npu.ref_loss, rtol=1e-5, atol=1e-5)
    assert grads.keys() == npu.ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, npu.ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
