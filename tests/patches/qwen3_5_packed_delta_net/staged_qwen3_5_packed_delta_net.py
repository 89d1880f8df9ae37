"""Packed Qwen3.5 samples stay apart in the gated delta-net layers without flash-linear-attention (FLA), as on CPU
and Ascend: each sample's causal convolution and recurrent state restart at its boundary.

A tiny Qwen3.5 and Qwen3.5-MoE, built from configs, after ``apply_monkey_patch`` with padding removed: the log-probs
of samples packed into one row (``cu_seqlens`` handed down as verl's FSDP engine hands them) equal those of each
sample run alone. Before the fix transformers' torch chunked rule, which takes ``**kwargs`` (transformers >= 5.9),
was handed ``cu_seqlens`` and ignored it: each sample's recurrence ran on from the previous sample's state.

Under Ulysses SP = 2, on two gloo ranks, the gated delta-net layer on each rank's shard of a packed row gives each
sample's output and the parameter gradients of each sample run alone. Before the fix Ulysses SP needed FLA's
context-parallel kernel (an ImportError without FLA)."""

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
)
from verl.models.transformers.monkey_patch import apply_monkey_patch
from verl.models.transformers.qwen3_5 import qwen3_5_gated_delta_net_forward
from verl.utils.ulysses import set_ulysses_sequence_parallel_group

VOCAB = 64
# A gated delta-net layer, then a full-attention one, as the real models interleave them; two value heads per key head.
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    layer_types=["linear_attention", "full_attention"],
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
        "partial_rotary_factor": 0.5,
    },
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=16)
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4)
# Under, over and well over one 64-token chunk, and a single token.
LENGTHS = [37, 90, 1, 70]
WORLD, TIMEOUT = 2, 300


def tiny_model(moe: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    if moe:
        text = {k: v for k, v in TEXT.items() if k != "intermediate_size"} | MOE
        model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text, vision_config=VISION))
    else:
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=TEXT, vision_config=VISION))
    with torch.no_grad():  # random weights of a scale that carries a state far
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.2)
    return model.eval()


def positions(lengths: list[int]) -> torch.Tensor:
    """Qwen3.5's (4, 1, seq) position ids of text-only samples packed in one row: each restarts at 0."""
    return torch.cat([torch.arange(n) for n in lengths]).expand(4, 1, -1)


def log_probs(model: torch.nn.Module, input_ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Each token's log-prob of the next token of its own sample: the row packed with boundaries ``lengths``, handed
    down as ``cu_seqlens`` where it holds more than one sample (one sample runs the layers' unpacked path)."""
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0)
    packed = dict(cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens) if len(lengths) > 1 else {}
    logits = model(input_ids=input_ids, position_ids=positions(lengths), use_cache=False, **packed).logits[0]
    scores = torch.log_softmax(logits.float(), dim=-1)
    return torch.cat([
        scores[start : end - 1].gather(-1, input_ids[0, start + 1 : end, None]).squeeze(-1)
        for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True)
    ])  # fmt: skip


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3_5", "qwen3_5_moe"])
def test_packed_samples_log_probs_equal_each_alone(moe):
    model = tiny_model(moe)
    apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=False)
    input_ids = torch.randint(0, VOCAB, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        packed = log_probs(model, input_ids, LENGTHS)
        alone = torch.cat([log_probs(model, ids, [ids.shape[1]]) for ids in input_ids.split(LENGTHS, 1)])
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-4)


def sample_outputs(layer, hidden: torch.Tensor, weights: torch.Tensor, lengths: list[int]) -> tuple:
    """transformers' own layer forward on each sample alone: the outputs, and the parameter gradients of the sum of
    the outputs times ``weights``."""
    outputs = [layer(h) for h in hidden.split(lengths, 1)]
    out = torch.cat(outputs, dim=1)
    grads = torch.autograd.grad((out * weights).sum(), list(layer.parameters()), allow_unused=True)
    return out.detach(), grads


def sp_rank(rank: int, rendezvous: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=TIMEOUT)
    )
    try:
        layer = tiny_model().model.language_model.layers[0].linear_attn.train()
        total = sum(LENGTHS)  # even: the row splits into WORLD equal shards, as verl pads it
        generator = torch.Generator().manual_seed(2)
        hidden = torch.randn(1, total, TEXT["hidden_size"], generator=generator)
        weights = torch.randn(1, total, TEXT["hidden_size"], generator=generator)
        expected, expected_grads = sample_outputs(layer, hidden, weights, LENGTHS)

        set_ulysses_sequence_parallel_group(dist.group.WORLD)
        shard = slice(rank * total // WORLD, (rank + 1) * total // WORLD)
        cu_seqlens = torch.tensor([0, *LENGTHS]).cumsum(0)
        out = qwen3_5_gated_delta_net_forward(layer, hidden[:, shard], cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens)
        grads = torch.autograd.grad((out * weights[:, shard]).sum(), list(layer.parameters()), allow_unused=True)
        shards = [torch.empty_like(out) for _ in range(WORLD)]
        dist.all_gather(shards, out.detach().contiguous())
        torch.testing.assert_close(torch.cat(shards, dim=1), expected, rtol=0, atol=1e-5)
        for grad, expected_grad in zip(grads, expected_grads, strict=True):
            if expected_grad is None:
                continue
            total_grad = torch.zeros_like(expected_grad) if grad is None else grad.contiguous()
            dist.all_reduce(total_grad)  # each rank's share: its sequence shard, then its heads
            torch.testing.assert_close(total_grad, expected_grad, rtol=1e-4, atol=1e-5)
    finally:
        set_ulysses_sequence_parallel_group(None)
        dist.destroy_process_group()


def test_ulysses_sp_packed_samples_equal_each_alone(tmp_path):
    context = mp.start_processes(
        sp_rank, args=(str(tmp_path / "rendezvous"),), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + TIMEOUT
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the SP ranks did not finish within {TIMEOUT} s")
