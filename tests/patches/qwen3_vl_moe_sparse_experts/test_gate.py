"""Where the sparse experts use ``torch._grouped_mm``: only where it is known to be right. On CUDA that is compute
capability 9.x (its backward on 10.x gives experts with no tokens a gradient, pytorch#172439); on the CPU it is
whether the kernel, tried once, gives a loop's result and an exactly zero gradient to an empty group. The CUDA
capability is monkeypatched: no CUDA tensor is made."""

from __future__ import annotations

import pytest
import torch

from verl_qwen3vl_plugin.patches.qwen3_vl_moe_sparse_experts import replacement as experts

CUDA = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def fresh_trial():
    experts._runs_right.cache_clear()
    yield
    experts._runs_right.cache_clear()


@pytest.mark.parametrize(
    ("capability", "expected"), [((8, 0), False), ((9, 0), True), ((10, 0), False), ((12, 0), False)]
)
def test_cuda_only_on_compute_capability_9(monkeypatch, capability, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(experts, "_runs_right", lambda device, dtype: True)  # the trial itself needs a GPU
    assert experts.grouped_mm_is_right(CUDA, torch.bfloat16) is expected
    assert experts.grouped_mm_is_right(CUDA, torch.float32) is False


def test_cuda_9_whose_trial_fails_falls_back(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(experts, "_runs_right", lambda device, dtype: False)
    assert experts.grouped_mm_is_right(CUDA, torch.bfloat16) is False


def test_cpu_goes_by_a_trial_run_not_the_symbol(monkeypatch):
    """The symbol is there but the kernel rejects the call (older torch builds): the fallback, decided once."""
    calls = []

    def rejecting(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("grouped_mm is not implemented for the CPU in this build")

    monkeypatch.setattr(torch, "_grouped_mm", rejecting, raising=False)
    cpu = torch.device("cpu")
    assert experts.grouped_mm_is_right(cpu, torch.float32) is False
    assert experts.grouped_mm_is_right(cpu, torch.float32) is False
    assert len(calls) == 1  # tried once, cached


def test_cpu_trial_rejects_a_kernel_that_leaks_gradient_into_empty_groups(monkeypatch):
    """A grouped product whose backward writes into the empty group's weight gradient, as pytorch#172439's does."""
    real = torch._grouped_mm

    class Leaky(torch.autograd.Function):
        @staticmethod
        def forward(ctx, rows, weight, offs):
            ctx.save_for_backward(weight)
            return real(rows, weight, offs=offs)

        @staticmethod
        def backward(ctx, grad):
            (weight,) = ctx.saved_tensors
            return None, torch.ones_like(weight), None

    monkeypatch.setattr(torch, "_grouped_mm", lambda rows, weight, offs: Leaky.apply(rows, weight, offs))
    assert experts.grouped_mm_is_right(torch.device("cpu"), torch.float32) is False


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
def test_cpu_trial_passes_on_this_torch():
    """torch 2.13's CPU kernel: right, so the sparse experts use it here (the suite's grouped_mm path)."""
    assert experts.grouped_mm_is_right(torch.device("cpu"), torch.float32) is True


def test_other_devices_and_dtypes_fall_back():
    assert experts.grouped_mm_is_right(torch.device("meta"), torch.float32) is False
    assert experts.grouped_mm_is_right(torch.device("cpu"), torch.float16) is False
