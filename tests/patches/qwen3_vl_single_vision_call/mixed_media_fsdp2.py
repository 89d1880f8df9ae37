"""Two FSDP2 ranks (gloo) holding different media run verl's own log-prob forward and its backward.

    mixed_media_fsdp2.py dense|moe|qwen3_5|qwen3_5_moe CASE[,CASE...] fsdp|alone [COLLECTIVE_TIMEOUT_S WALL_TIMEOUT_S]

verl 0.7.x: ``DataParallelPPOActor._forward_micro_batch``; verl >= 0.8: the FSDP engine's ``forward_step`` (both
with remove-padding, after ``apply_monkey_patch``). The model is sharded as verl's FSDP2 wrapping does:
``fully_shard`` on each vision block, each decoder layer and the root. Per rank and case: the same micro-batch is
first computed alone, in this process without FSDP (the reference), then under FSDP2. Prints one JSON list (per
rank, per case): the ``model.visual`` calls of each pass, the largest log-prob difference, and the largest gradient
difference against the mean of the two ranks' reference gradients (what FSDP's reduce-scatter computes), relative to
each gradient's largest entry. A rank that fails reports ``{"error": ...}``; the group's timeout and the wall-clock
limit bound a hang (the negative controls run with the patch disabled). ``alone``: the reference passes only.

CPU stand-ins: ``verl_qwen3vl_plugin.selftest.ulysses`` (the package's testing code) names them.
"""

import json
import sys

import torch
import torch.distributed as dist
from seeded_pass import full, seeded_pass  # tests/_child, on every child's PYTHONPATH
from ulysses_ranks import shard  # tests/_child, on every child's PYTHONPATH

from verl_qwen3vl_plugin.selftest.ranks import on_two_ranks
from verl_qwen3vl_plugin.selftest.ulysses import build_model, install_cpu_stand_ins, micro_batch

# Per case, each rank's micro-batch: per sample its images as (t, h, w), videos as ("v", t, h, w).
CASES = {
    "image_video_vs_images": ([[(1, 4, 6), ("v", 2, 4, 4)]], [[(1, 4, 4)], [(1, 2, 2)]]),
    "image_video_vs_text": ([[("v", 2, 4, 4)], [(1, 4, 4)]], [[], []]),
    "video_vs_image": ([[("v", 2, 4, 4)]], [[(1, 4, 6)]]),
}


def one_pass(model, batch):
    """verl's forward and a seeded loss's backward: (log-probs, gradients, model.visual calls)."""
    calls = []
    hook = model.model.visual.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[0]))
    try:
        log_probs, _ = seeded_pass(model, batch, sp=1)
    finally:
        hook.remove()
    grads = [full(p.grad) if p.grad is not None else torch.zeros(p.shape) for p in model.parameters()]
    return log_probs, grads, calls


def run_rank(rank, kind, cases, mode):
    import verl  # noqa: F401  (the plugin activates here, as in a user's worker)
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    from verl_qwen3vl_plugin import patch_statuses

    install_cpu_stand_ins()
    results = {"rank": rank}
    for case in cases.split(","):
        batch = micro_batch(CASES[case][rank])
        alone = build_model(kind)
        apply_monkey_patch(alone, ulysses_sp_size=1, use_remove_padding=True, use_fused_kernels=False)
        ref_log_probs, ref_grads, alone_calls = one_pass(alone, batch)
        results[case] = {"visual_calls_alone": len(alone_calls)}
        if mode == "alone":
            continue
        for grad in ref_grads:  # the mean over the ranks, as FSDP's reduce-scatter averages
            dist.all_reduce(grad)
            grad /= dist.get_world_size()
        log_probs, grads, fsdp_calls = one_pass(shard(build_model(kind)), batch)
        results[case].update(
            visual_calls_fsdp=len(fsdp_calls),
            log_prob_diff=float((log_probs - ref_log_probs).abs().max()),
            grad_rel_diff=max(
                float((g - r).abs().max() / r.abs().max().clamp(min=1e-12))
                for g, r in zip(grads, ref_grads, strict=True)
            ),
        )
    results["statuses"] = {f"{s.patch} {s.target}": s.status.value for s in patch_statuses()}
    return results


if __name__ == "__main__":
    kind, cases, mode, *limits = sys.argv[1:]
    collective, wall = (float(x) for x in limits) if limits else (300.0, 600.0)
    print(json.dumps(on_two_ranks(run_rank, kind, cases, mode, timeout=wall, collective_timeout=collective)))
