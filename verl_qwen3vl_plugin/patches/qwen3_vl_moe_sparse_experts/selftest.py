"""Checks of the ``qwen3_vl_moe_sparse_experts`` patch: the plugin's grouped experts against transformers 4.57's
training loop and dense eval, holding the same weights and routing."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from verl_qwen3vl_plugin.selftest import Check

FP32_TOLERANCE = 1e-5  # relative, and absolute in units of the largest reference entry
BF16_TOLERANCE = 2e-2  # bf16 against an fp32 reference: relative to the largest reference entry


class ExpertsRun(NamedTuple):
    out: torch.Tensor
    grads: dict[str, torch.Tensor]  # "input", "routing_weights" (the top-k entries) and each parameter


def routed_inputs(
    config, tokens: int = 37, seed: int = 5, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states (1, tokens, H), the dense (tokens, E) routing matrix and the top-k indices, as the block makes."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, tokens, config.hidden_size, generator=generator)
    logits = torch.randn(tokens, config.num_experts, generator=generator)
    top, indices = torch.softmax(logits, -1).topk(config.num_experts_per_tok, dim=-1)
    dense = torch.zeros_like(logits).scatter_(1, indices, top / top.sum(-1, keepdim=True))
    return hidden.to(dtype), dense.to(dtype), indices


def experts_run(experts: torch.nn.Module, forward: Callable, inputs: tuple, training: bool) -> ExpertsRun:
    """Forward and backward (a seeded output gradient) of ``forward(experts, hidden, routing_weights, indices)``."""
    experts.train(training)
    experts.zero_grad()
    hidden, dense, indices = (t.clone().requires_grad_(t.is_floating_point()) for t in inputs)
    out = forward(experts, hidden, dense, indices)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(6)).to(out.dtype)
    out.backward(grad)
    # The block scatters the top-k weights into the dense matrix: only the selected entries' gradients reach them.
    grads = {"input": hidden.grad, "routing_weights": dense.grad.gather(1, indices)}
    grads.update({n: p.grad for n, p in experts.named_parameters()})
    return ExpertsRun(out.detach(), grads)


def close_check(name: str, actual: ExpertsRun, expected: ExpertsRun, tolerance: float, grads: bool = True) -> Check:
    """Every tensor within ``tolerance`` of the reference, relative to the reference's largest entry."""
    pairs = {"output": (actual.out, expected.out)}
    if grads:
        pairs.update({f"{k} gradient": (actual.grads[k], g) for k, g in expected.grads.items()})
    errors = {k: float((a.float() - e.float()).abs().max() / e.float().abs().max()) for k, (a, e) in pairs.items()}
    worst = max(errors, key=errors.get)
    return Check(name, errors[worst] <= tolerance, f"max relative difference {errors[worst]:.1e} ({worst}; "
                 f"tolerance {tolerance:.0e})")  # fmt: skip


def same_bits_check(name: str, actual: ExpertsRun, expected: ExpertsRun) -> Check:
    same = torch.equal(actual.out, expected.out)
    return Check(name, same, "bit-identical" if same else f"max |difference| {(actual.out - expected.out).abs().max()}")


def tiny_experts(**text: int) -> tuple[torch.nn.Module, object]:
    """transformers' ``Qwen3VLMoeTextExperts`` of the tiny config (8 experts, top-2 unless ``text`` says otherwise),
    and that text config."""
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextExperts

    from verl_qwen3vl_plugin.selftest.tiny_models import randomize, tiny_qwen3_vl_moe_config

    config = tiny_qwen3_vl_moe_config(**{"num_experts": 8, **text}).text_config
    return randomize(Qwen3VLMoeTextExperts(config), seed=2), config


def run() -> list[Check]:
    from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe

    from verl_qwen3vl_plugin import originals
    from verl_qwen3vl_plugin.patches.qwen3_vl_moe_sparse_experts.replacement import sparse_experts_forward
    from verl_qwen3vl_plugin.patches.qwen3_vl_moe_sparse_experts.spec import PATCH
    from verl_qwen3vl_plugin.registry import Verdict, decide_installed

    decision = decide_installed(PATCH, PATCH.targets[0])

    verdict, reason = decision.verdict, decision.reason
    checks = [Check("moe experts decision", verdict is not Verdict.UNRECOGNIZED, f"{verdict.value}: {reason}")]
    if verdict is not Verdict.APPLY:
        return checks
    upstream = originals.original(modeling_qwen3_vl_moe.Qwen3VLMoeTextExperts, "forward")
    experts, config = tiny_experts()
    inputs = routed_inputs(config)
    train = experts_run(experts, sparse_experts_forward, inputs, training=True)
    checks.append(close_check("moe experts training vs transformers' loop (fp32)", train,
                              experts_run(experts, upstream, inputs, training=True), FP32_TOLERANCE))  # fmt: skip
    evaluation = experts_run(experts, sparse_experts_forward, inputs, training=False)
    checks.append(close_check("moe experts eval vs transformers' dense eval (fp32)", evaluation,
                              experts_run(experts, upstream, inputs, training=False), FP32_TOLERANCE))  # fmt: skip
    checks.append(same_bits_check("moe experts eval output == training output", evaluation, train))
    return checks
