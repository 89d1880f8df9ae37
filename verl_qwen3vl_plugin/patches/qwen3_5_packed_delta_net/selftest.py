"""Self-test of ``qwen3_5_packed_delta_net``: a tiny Qwen3.5 with images, after verl's ``apply_monkey_patch``, through
verl's FSDP engine ``forward_step`` with padding removed: log-probs and parameter gradients of one packed micro-batch
against each sample run alone with the upstream layers (transformers' own fallback, or verl's loop)."""

from __future__ import annotations

import json
from contextlib import contextmanager

import torch

from verl_qwen3vl_plugin.selftest import Check, in_child

# Very different lengths, one below a 64-token chunk: 26, 90 and 221 tokens with the response.
SAMPLES = [[(1, 4, 4)], [(1, 16, 20)], [(1, 8, 8), (1, 24, 32)]]
# fp32: the plugin's chunk grid and block inverse sum in another order than transformers' loop.
LOG_PROB_ATOL, GRAD_RTOL = 1e-4, 1e-4


def layer_classes() -> list[type]:
    """transformers' Qwen3.5 decoder-layer and gated delta-net classes."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as dense
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as moe

    return [
        dense.Qwen3_5DecoderLayer, dense.Qwen3_5GatedDeltaNet, moe.Qwen3_5MoeDecoderLayer, moe.Qwen3_5MoeGatedDeltaNet,
    ]  # fmt: skip


@contextmanager
def upstream_layers():
    """The layers' forwards as they were before the plugin wrapped them (verl's or transformers'): the patch off."""
    from verl_qwen3vl_plugin import originals

    saved = {cls: cls.forward for cls in layer_classes()}
    for cls, forward in saved.items():  # verl 0.9 sets the plugin's wrapper of its own function on the class
        cls.forward = forward.__wrapped__ if originals.ours(forward) else forward
    try:
        yield
    finally:
        for cls, forward in saved.items():
            cls.forward = forward


def verl_model(kind: str = "qwen3_5") -> torch.nn.Module:
    """The tiny model (``qwen3_5`` or ``qwen3_5_moe``) after verl's ``apply_monkey_patch`` with padding removed."""
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    from verl_qwen3vl_plugin.selftest.ulysses import build_model, install_cpu_stand_ins

    install_cpu_stand_ins()
    model = build_model(kind)
    apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=False)
    return model


def _sample(batch: dict, i: int) -> dict:
    return {key: value[i : i + 1] for key, value in batch.items()}


def _pass(model: torch.nn.Module, batch: dict, weights: torch.Tensor) -> tuple[torch.Tensor, dict]:
    from verl_qwen3vl_plugin.selftest.ulysses import engine_forward

    model.zero_grad(set_to_none=True)
    log_probs, _ = engine_forward(model, batch, sp=1)
    (log_probs * weights).sum().backward()
    return log_probs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def packed_against_alone(model: torch.nn.Module, samples: list = SAMPLES, patched: bool = True) -> dict:
    """The largest differences between the packed micro-batch (``patched``: as installed, else the upstream layers)
    and its samples run one at a time with the upstream layers: log-probs, and gradients relative to their largest."""
    from verl_qwen3vl_plugin.selftest.ulysses import micro_batch

    batch = micro_batch(samples)
    lengths = batch["attention_mask"].sum(-1).tolist()
    weights = torch.randn(sum(lengths), generator=torch.Generator().manual_seed(7))
    if patched:
        packed, packed_grads = _pass(model, batch, weights)
    with upstream_layers():
        if not patched:
            packed, packed_grads = _pass(model, batch, weights)
        alone, grads = [], {}
        for i, chunk in enumerate(weights.split(lengths)):
            log_probs, sample_grads = _pass(model, _sample(batch, i), chunk)
            alone.append(log_probs)
            for name, grad in sample_grads.items():
                grads[name] = grads.get(name, 0) + grad
    grad_diff = max(float((packed_grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-12)) for n, g in grads.items())
    return {
        "lengths": lengths,
        "log_prob_diff": float((packed - torch.cat(alone)).abs().max()),
        "grad_rel_diff": grad_diff,
    }


def checks_here() -> list[Check]:
    """In a process of its own (``apply_monkey_patch`` rewires transformers' Qwen3.5 for the rest of it, and prints):
    verl imported, the model hooks installed."""
    import verl  # noqa: F401

    from verl_qwen3vl_plugin.hooks import watch_group
    from verl_qwen3vl_plugin.registry import MODEL

    watch_group(MODEL)
    found = packed_against_alone(verl_model())
    ok = found["log_prob_diff"] <= LOG_PROB_ATOL and found["grad_rel_diff"] <= GRAD_RTOL
    return [Check(f"packed Qwen3.5 samples of lengths {found['lengths']} equal each alone", ok, str(found))]


def run() -> list[Check]:
    from verl_qwen3vl_plugin.registry import DISABLE_ENV
    from verl_qwen3vl_plugin.selftest.tiny_models import has_qwen3_5

    if not has_qwen3_5(verl=True):
        return [Check("packed Qwen3.5 samples", True, "no Qwen3.5 in this verl / transformers: nothing to check")]
    return in_child(__name__, "packed Qwen3.5 samples", drop=(DISABLE_ENV,))  # the patch, not the user's setup


if __name__ == "__main__":
    print(json.dumps([list(c) for c in checks_here()]))
