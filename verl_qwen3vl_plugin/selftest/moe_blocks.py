"""Qwen3-VL-MoE sparse blocks side by side: transformers' block and verl's NPU block holding the same weights."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from verl_qwen3vl_plugin.selftest.tiny_models import MOE_TEXT, randomize, tiny_qwen3_vl_moe_config


@dataclass
class BlockRun:
    out: torch.Tensor
    input_grad: torch.Tensor
    param_grads: dict[str, torch.Tensor]


def block_pair(hf_cls: type, npu_cls: type, num_experts: int, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Build both blocks from the tiny config with ``num_experts`` experts and copy the HF weights into the NPU one."""
    config = tiny_qwen3_vl_moe_config().text_config
    config.num_experts = num_experts
    hf = randomize(hf_cls(config), seed)
    npu = npu_cls(config)
    npu.load_state_dict(hf.state_dict())
    return hf, npu


def block_input(seed: int = 3) -> torch.Tensor:
    return torch.randn(2, 5, MOE_TEXT["hidden_size"], generator=torch.Generator().manual_seed(seed))


def run_block(
    block: torch.nn.Module, x: torch.Tensor, training: bool, forward: Callable | None = None, seed: int = 4
) -> BlockRun:
    """Forward (``forward(block, x)`` if given, else the block's own) and backward with a seeded output gradient."""
    block.train(training)
    block.zero_grad()
    x = x.clone().requires_grad_()
    out = forward(block, x) if forward is not None else block(x)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)))
    return BlockRun(out.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()})
