"""The Ascend Qwen3-VL-MoE experts (``verl/models/transformers/npu_patch.py``) in eval compute only the experts each
token is routed to: an eval forward of the sparse block costs what a training forward costs, where before it ran every
expert on every token (E / top_k times the expert FLOPs; here 4x). Its output is still transformers' block's with the
same weights (within float rounding) and, now that eval runs training's grouped path, a training forward's bit for
bit: verl's old and reference log-probs (eval) and the actor's (training) see the same experts' numbers.

verl's module runs on the CPU over small stand-ins for the four ``torch_npu`` ops it calls, written from the Ascend op
documentation (below); FLOPs are counted by ``torch.utils.flop_counter`` on the matmuls the block and the stand-ins
run.
"""

import importlib.util
import sys
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode
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


@pytest.fixture
def npu_block(monkeypatch):
    """verl's NPU sparse block, from verl's module loaded on the stand-ins from its file under a name of its own (so
    ``sys.modules`` never holds it with them)."""
    monkeypatch.setitem(sys.modules, "torch_npu", cpu_torch_npu())
    monkeypatch.setattr(torch, "histc", integer_histc)
    origin = importlib.util.find_spec("verl.models.transformers.npu_patch").origin
    spec = importlib.util.spec_from_file_location("npu_patch_on_cpu_stand_ins", origin)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.NPUQwen3VLMoeTextSparseMoeBlock


def forward(block, x, training):
    """The block's output (without gradients, as verl computes log-probs) and the FLOPs it took."""
    block.train(training)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        out = block(x)
    return (out[0] if isinstance(out, tuple) else out), counter.get_total_flops()


def test_eval_runs_only_the_routed_experts(npu_block):
    # hidden 16, expert intermediate 12: the two packings of the experts differ in shape, so the copy below is exact.
    config = Qwen3VLMoeTextConfig(
        vocab_size=32,
        hidden_size=16,
        moe_intermediate_size=12,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    reference = modeling_qwen3_vl_moe.Qwen3VLMoeTextSparseMoeBlock(config)  # transformers' own
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # built from a config, the experts hold uninitialised memory
        for param in reference.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    block = npu_block(config)
    state = block.state_dict()
    # verl's block packs the experts as transformers 4.57 does; transformers 5 stores the per-expert transposes.
    block.load_state_dict(
        {
            name: value if value.shape == state[name].shape else value.transpose(1, 2)
            for name, value in reference.state_dict().items()
        }
    )
    x = torch.randn(2, 5, config.hidden_size, generator=generator)

    out, eval_flops = forward(block, x, training=False)
    expected, _ = forward(reference, x, training=False)
    training_out, training_flops = forward(block, x, training=True)

    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert eval_flops == training_flops, f"eval took {eval_flops / training_flops:.1f}x a training forward's FLOPs"
    torch.testing.assert_close(out, training_out, rtol=0, atol=0)
