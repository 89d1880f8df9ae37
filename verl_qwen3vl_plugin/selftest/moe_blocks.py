"""Qwen3-VL-MoE side by side: transformers' block (or model) and verl's NPU one holding the same weights, and verl's
FSDP engine streaming a model's weights for the rollout."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from verl_qwen3vl_plugin.environment import dist_version
from verl_qwen3vl_plugin.selftest.tiny_models import MOE_TEXT, randomize, tiny_qwen3_vl_moe_config

EXPERT_TENSORS = ("experts.gate_up_proj", "experts.down_proj")


@dataclass
class BlockRun:
    out: torch.Tensor
    input_grad: torch.Tensor
    param_grads: dict[str, torch.Tensor]


def npu_layout(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' expert tensors (weights or gradients) in the layout of verl's NPU block, and back.

    verl's block packs experts as transformers 4.57 does, (E, H, 2I) and (E, I, H); transformers 5 stores the
    per-expert transposes. A transpose is its own inverse, so the same mapping serves both directions.
    """
    if dist_version("transformers").major < 5:
        return dict(tensors)
    return {k: v.transpose(1, 2) if k.endswith(EXPERT_TENSORS) and v.dim() == 3 else v for k, v in tensors.items()}


def block_pair(hf_cls: type, npu_cls: type, num_experts: int, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Build both blocks from the tiny config with ``num_experts`` experts and copy the HF weights into the NPU one."""
    config = tiny_qwen3_vl_moe_config(num_experts=num_experts).text_config
    hf = randomize(hf_cls(config), seed)
    npu = npu_cls(config)
    npu.load_state_dict(npu_layout(hf.state_dict()))
    return hf, npu


def block_input(seed: int = 3) -> torch.Tensor:
    return torch.randn(2, 5, MOE_TEXT["hidden_size"], generator=torch.Generator().manual_seed(seed))


def run_block(
    block: torch.nn.Module, x: torch.Tensor, training: bool, forward: Callable | None = None, seed: int = 4
) -> BlockRun:
    """Forward (``forward(block, x)`` if given, else the block's own) and backward with a seeded output gradient.

    Parameter gradients come back in transformers' layout, so an NPU block's compare with transformers' directly.
    """
    block.train(training)
    block.zero_grad()
    x = x.clone().requires_grad_()
    out = forward(block, x) if forward is not None else block(x)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)))
    grads = {n: p.grad for n, p in block.named_parameters()}
    return BlockRun(out.detach(), x.grad, npu_layout(grads) if type(block).__module__.startswith("verl.") else grads)


@contextlib.contextmanager
def on_the_cpu(transformer_impl) -> Iterator[None]:
    """verl's memory log and device id ask the accelerator; on the CPU they are the only stand-ins."""
    saved = transformer_impl.log_gpu_memory_usage, transformer_impl.get_device_id
    transformer_impl.log_gpu_memory_usage = lambda *args, **kwargs: None
    transformer_impl.get_device_id = lambda: "cpu"
    try:
        yield
    finally:
        transformer_impl.log_gpu_memory_usage, transformer_impl.get_device_id = saved


def engine_weight_stream(model: torch.nn.Module, method: Callable | None = None) -> dict[str, torch.Tensor]:
    """What verl's FSDP engine (``FSDPEngine.get_per_tensor_param``, or ``method`` in its place) sends the rollout for
    ``model`` (unsharded)."""
    from verl.workers.engine.fsdp import transformer_impl

    engine = SimpleNamespace(
        module=model,
        model_config=SimpleNamespace(lora={}, hf_config=model.config),
        _uses_fsdp2_cpu_offload_policy=True,  # no FSDP here: nothing to stage on a device
        _is_offload_param=False,
        _qat_enabled=False,
    )
    with on_the_cpu(transformer_impl):
        weights, _ = (method or transformer_impl.FSDPEngine.get_per_tensor_param)(engine)
        return dict(weights)
