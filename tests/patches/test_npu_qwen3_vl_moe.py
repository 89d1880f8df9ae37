"""verl's real Ascend ``npu_patch`` run on the CPU through reference ``torch_npu`` ops, without and with the plugin.

verl's npu_patch rewires transformers' Qwen3 modules for the rest of the process, so this module runs in its own
pytest process (marker ``fake_npu``; see noxfile.py). References are computed before it is imported.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import TRANSFORMERS
from verl_qwen3vl_plugin.registry import Status, patch_statuses
from verl_qwen3vl_plugin.testing.npu_reference import fake_torch_npu
from verl_qwen3vl_plugin.testing.tiny_models import MOE_TEXT, tiny_qwen3_vl_moe, tiny_qwen3_vl_moe_config

# verl's NPU block keeps transformers 4.57's expert layout, (experts, hidden, 2 * intermediate); transformers 5 stores
# (experts, 2 * intermediate, hidden), so weights only carry over, and numbers only compare, on transformers 4.x.
SAME_LAYOUT = TRANSFORMERS.release < (5,)
same_layout = pytest.mark.skipif(not SAME_LAYOUT, reason="verl's NPU block and transformers 5 differ in expert layout")
pytestmark = pytest.mark.fake_npu
TOKENS = 10


def randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Modules built from a config may hold uninitialised memory: give every parameter seeded values."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    return module


def text_config(num_experts: int):
    config = tiny_qwen3_vl_moe_config().text_config
    config.num_experts = num_experts
    return config


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
        from verl_qwen3vl_plugin.patches import npu_qwen3_vl_moe

        npu_qwen3_vl_moe.install()  # npu_patch is already imported: the hook acts right away
        yield SimpleNamespace(
            hf_block=hf_block,
            npu_block=block,
            verl_forward=verl_forward,
            patched=block.forward is not verl_forward,
            state=reference.state_dict(),
            ref_loss=ref_loss,
            ref_grads=ref_grads,
        )


def blocks(npu, num_experts: int, seed: int = 0):
    config = text_config(num_experts)
    hf = randomize(npu.hf_block(config), seed)
    ours = npu.npu_block(config)
    ours.load_state_dict(hf.state_dict())
    return hf, ours


def run(block_or_forward, block, x):
    out = block_or_forward(x) if block_or_forward is block else block_or_forward(block, x)
    return out[0] if isinstance(out, tuple) else out


def test_status_matches_the_installed_verl(npu):
    status = patch_statuses()["npu_qwen3_vl_moe_routing"]
    if npu.patched:
        assert status.status is Status.APPLIED, status
    else:
        assert status.status is Status.FIXED_UPSTREAM, status
        assert npu.npu_block.forward is npu.verl_forward


def affected(npu):
    if not npu.patched:
        pytest.skip("this verl's NPU block scatters in training; nothing to fix")


def test_bug_without_plugin_index_error_when_experts_outnumber_top_k(npu):
    affected(npu)
    _, block = blocks(npu, num_experts=4)
    block.train()
    with pytest.raises(IndexError):
        run(npu.verl_forward, block, torch.randn(2, TOKENS // 2, MOE_TEXT["hidden_size"]))


def test_bug_without_plugin_wrong_numbers_when_experts_equal_top_k(npu):
    affected(npu)
    hf, block = blocks(npu, num_experts=MOE_TEXT["num_experts_per_tok"])
    hf.train(), block.train()
    x = torch.randn(2, TOKENS // 2, MOE_TEXT["hidden_size"])
    assert not torch.allclose(run(npu.verl_forward, block, x), run(hf, hf, x), atol=1e-3)


@same_layout
@pytest.mark.parametrize("num_experts", [4, 2])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_block_matches_transformers_outputs_and_gradients(npu, num_experts, training):
    hf, block = blocks(npu, num_experts)
    hf.train(training), block.train(training)
    x = torch.randn(2, TOKENS // 2, MOE_TEXT["hidden_size"], generator=torch.Generator().manual_seed(3))
    x_hf, x_npu = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_hf, out_npu = run(hf, hf, x_hf), run(block, block, x_npu)
    torch.testing.assert_close(out_npu, out_hf, rtol=1e-5, atol=1e-5)
    grad = torch.randn(out_hf.shape, generator=torch.Generator().manual_seed(4))
    out_hf.backward(grad), out_npu.backward(grad)
    torch.testing.assert_close(x_npu.grad, x_hf.grad, rtol=1e-5, atol=1e-5)
    for name, p in hf.named_parameters():
        torch.testing.assert_close(dict(block.named_parameters())[name].grad, p.grad, rtol=1e-5, atol=1e-5, msg=name)


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
