"""The Ascend Qwen3-VL-MoE sparse block (``verl/models/transformers/npu_patch.py``) against transformers' own block
with the same weights, in training and in eval: outputs, input gradients and weight gradients. verl's module runs on
the CPU over small stand-ins for the four ``torch_npu`` ops it calls, written from the Ascend op documentation (below).

Before the fix the block scattered its top-k routing weights into the dense (tokens, experts) matrix only in eval,
while the experts' training path reads ``routing_weights[token, router_indices]`` from that matrix: in training it
read the (tokens, top_k) weights with expert ids as column indices. With more experts than top_k that is an
IndexError on the CPU (on Ascend, out-of-bounds reads); with as many, the weights of a token's two experts are swapped
whenever the second has the smaller id, so the output and the gradients differ from transformers'.
"""

import importlib
import importlib.util
import sys
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe
from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeTextConfig

# --- CPU stand-ins for the torch_npu ops of the block, from the Ascend op documentation ---------------------------


def npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False):
    """Each token copied once per expert it is routed to, the copies grouped by expert id (stable within one).
    Returns them and, for each copy, its position in ``indices.flatten()``."""
    top_k = indices.shape[1]
    order = torch.argsort(indices.flatten(), stable=True)
    return tokens.index_select(0, order // top_k), order.to(torch.int32)


def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    """The inverse of the permute: each token's copies summed, each scaled by ``probs[token, k]``."""
    positions = sorted_indices.long()
    top_k = probs.shape[1]
    rows = permuted_tokens * probs.flatten().index_select(0, positions).unsqueeze(1).to(permuted_tokens.dtype)
    out = permuted_tokens.new_zeros(positions.numel() // top_k, permuted_tokens.shape[1])
    return out.index_add(0, positions // top_k, rows)


def npu_grouped_matmul(x, weight, *, bias=None, group_list, split_item=0, group_type=0, group_list_type=0):
    """One weight per group. ``group_type`` 0: the rows of ``x`` split into groups (``group_list``: the group sizes
    for ``group_list_type`` 1, their running sums for 0), group g's rows times ``weight[g]``; 2: the reduction axis
    split, ``x[:, K_g] @ weight[K_g]`` stacked (a weight gradient)."""
    (a,), (b,) = x, weight
    counts = group_list.long()
    ends = torch.cumsum(counts, 0).tolist() if group_list_type == 1 else counts.tolist()
    bounds = list(zip([0, *ends[:-1]], ends, strict=True))
    if group_type == 0:
        return [torch.cat([a[start:end] @ b[g] for g, (start, end) in enumerate(bounds)])]
    return [torch.stack([a[:, start:end] @ b[start:end] for start, end in bounds])]


def npu_swiglu(x, dim=-1):
    """Swish of the first half of ``x`` along ``dim`` times its second half."""
    first, second = x.chunk(2, dim=dim)
    return F.silu(first) * second


CPU_HISTC = torch.histc


def integer_histc(input, bins=100, min=0, max=0, **kwargs):
    """``torch.histc`` of expert ids, as Ascend counts integer tensors (the CPU kernel takes floating point only)."""
    return CPU_HISTC(input.float(), bins=bins, min=min, max=max, **kwargs)


def cpu_torch_npu():
    module = ModuleType("torch_npu")
    for op in (npu_moe_token_permute, npu_moe_token_unpermute, npu_grouped_matmul, npu_swiglu):
        setattr(module, op.__name__, op)
    return module


# --- verl's module on them ----------------------------------------------------------------------------------------

# The transformers modules whose classes and functions npu_patch rebinds when it is imported.
PATCHED_MODELS = ("qwen2", "qwen2_5_vl", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_vl", "qwen3_vl_moe")


@pytest.fixture
def blocks(monkeypatch):
    """transformers' Qwen3-VL-MoE sparse block and verl's NPU one, from verl's module loaded on the stand-ins from
    its file under a name of its own (so ``sys.modules`` never holds it with them); whatever its import rebinds in
    transformers is restored when the test ends."""
    monkeypatch.setitem(sys.modules, "torch_npu", cpu_torch_npu())
    monkeypatch.setattr(torch, "histc", integer_histc)
    for model in PATCHED_MODELS:
        module = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
        for name, value in list(vars(module).items()):
            monkeypatch.setattr(module, name, value)
            if isinstance(value, type) and value.__module__ == module.__name__ and "forward" in vars(value):
                monkeypatch.setattr(value, "forward", vars(value)["forward"])
    transformers_block = modeling_qwen3_vl_moe.Qwen3VLMoeTextSparseMoeBlock
    origin = importlib.util.find_spec("verl.models.transformers.npu_patch").origin
    spec = importlib.util.spec_from_file_location("npu_patch_on_cpu_stand_ins", origin)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return transformers_block, module.NPUQwen3VLMoeTextSparseMoeBlock


def run(block, x, training):
    """Forward and backward (a seeded output gradient): the output, the input's and the parameters' gradients."""
    block.train(training)
    block.zero_grad()
    x = x.clone().requires_grad_()
    out = block(x)
    out = out[0] if isinstance(out, tuple) else out  # transformers' block also returns its router logits
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)))
    return out.detach(), x.grad, {name: p.grad for name, p in block.named_parameters()}


@pytest.mark.parametrize("num_experts", [4, 2], ids=["experts_outnumber_top_k", "experts_equal_top_k"])
def test_npu_block_matches_transformers_in_training_and_eval(blocks, num_experts):
    transformers_block, npu_block = blocks
    config = Qwen3VLMoeTextConfig(
        vocab_size=32,
        hidden_size=16,
        moe_intermediate_size=8,
        num_experts=num_experts,
        num_experts_per_tok=2,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    reference = transformers_block(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # built from a config, the experts hold uninitialised memory
        for param in reference.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    block = npu_block(config)
    block.load_state_dict(reference.state_dict())  # transformers 4.57's expert layout, which verl's block keeps
    x = torch.randn(2, 5, config.hidden_size, generator=generator)

    for training in (False, True):
        out, x_grad, grads = run(block, x, training)
        expected_out, expected_x_grad, expected_grads = run(reference, x, training)
        torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x_grad, expected_x_grad, rtol=1e-5, atol=1e-5)
        assert grads.keys() == expected_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(
                grad, expected_grads[name], rtol=1e-5, atol=1e-5, msg=lambda detail, name=name: f"{name}: {detail}"
            )
