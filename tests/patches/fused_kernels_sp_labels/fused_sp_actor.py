"""verl 0.7.x's own actor forward with fused kernels (torch backend) and remove-padding, Ulysses SP = 2 on two CPU
ranks (gloo) against SP = 1 on the same micro-batch and weights.

    fused_sp_actor.py dense|moe none|fsdp2

On each rank: verl's ``apply_monkey_patch(model, ulysses_sp_size=2, use_fused_kernels=True)``, then
``DataParallelPPOActor._forward_micro_batch`` with ``use_fused_kernels``, first with no Ulysses group (SP = 1), then
with the world as the group (SP = 2); the seeded loss's backward after each. Prints one JSON list (per rank): the
largest difference of log-probs, the samples whose log-probs differ, and the largest relative gradient difference
(gradients averaged over the ranks, as FSDP reduces them).

CPU stand-ins: ``verl_qwen3vl_plugin.selftest.ulysses`` names them.
"""

import json
import sys

import torch
import torch.distributed as dist
from seeded_pass import averaged_grads  # tests/_child, on every child's PYTHONPATH
from ulysses_ranks import shard  # tests/_child, on every child's PYTHONPATH

from verl_qwen3vl_plugin.selftest.ranks import on_two_ranks
from verl_qwen3vl_plugin.selftest.ulysses import actor_for, build_model, install_cpu_stand_ins, micro_batch

SAMPLES = [[(1, 4, 6)], [(1, 2, 2), (1, 8, 8)], [(1, 4, 4)]]  # images per sample, as (t, h, w) grids


def fused_pass(model, batch, sp):
    """(log-probs, gradients) of verl's fused forward at ``sp`` and the seeded loss."""
    from verl.utils.ulysses import set_ulysses_sequence_parallel_group

    model.zero_grad(set_to_none=True)
    set_ulysses_sequence_parallel_group(dist.group.WORLD if sp > 1 else None)
    try:
        actor = actor_for(model, sp, use_fused_kernels=True)
        out = actor._forward_micro_batch(batch, temperature=1.0, calculate_entropy=True)
    finally:
        set_ulysses_sequence_parallel_group(None)
    log_probs = out["log_probs"] if isinstance(out, dict) else out[1]  # verl 0.7.1 a dict, 0.7.0 (entropy, lp)
    weights = torch.randn(log_probs.shape, generator=torch.Generator().manual_seed(5))
    (log_probs * weights).sum().backward()
    grads = averaged_grads(model, sp)
    return log_probs.detach(), grads


def run_rank(rank, kind, fsdp):
    import verl  # noqa: F401  (the plugin activates here, as in a user's worker)
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    from verl_qwen3vl_plugin import patch_statuses

    install_cpu_stand_ins()
    model = build_model(kind)
    apply_monkey_patch(
        model, ulysses_sp_size=2, use_remove_padding=True, use_fused_kernels=True, fused_kernels_backend="torch"
    )
    if fsdp != "none":
        shard(model)
    batch = micro_batch(SAMPLES)
    ref_lp, ref_grads = fused_pass(model, batch, 1)
    lp, grads = fused_pass(model, batch, 2)
    differ = (lp - ref_lp).abs()
    return {
        "rank": rank,
        "log_prob_diff": float(differ.max()),
        "samples_that_differ": sorted({int(i) for i in differ.nonzero()[:, 0]}),
        "grad_rel_diff": max(
            float((grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-12)) for n, g in ref_grads.items()
        ),
        "statuses": {f"{s.patch} {s.target}": s.status.value for s in patch_statuses()},
    }


if __name__ == "__main__":
    kind, fsdp = sys.argv[1:]
    print(json.dumps(on_two_ranks(run_rank, kind, fsdp, timeout=400, collective_timeout=120)))
