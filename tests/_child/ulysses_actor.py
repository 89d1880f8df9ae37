"""verl's own actor forward with Ulysses SP = 2 on two CPU ranks (gloo), against SP = 1 on the same batch and weights.

    ulysses_actor.py dense|moe|qwen3_5|qwen3_5_moe CASE[,CASE...] none|fsdp2|fsdp2_offload [shuffled]

On each rank: ``DataParallelPPOActor._forward_micro_batch`` (verl 0.7.x; on verl >= 0.8 the FSDP engine's
``forward_step``) with remove-padding after verl's ``apply_monkey_patch(model, ulysses_sp_size=2)``, first with no
Ulysses group (SP = 1), then with ``set_ulysses_sequence_parallel_group`` on both ranks (SP = 2). Loss: fixed
random weights on the log-probs and entropies. Prints one JSON list (per rank, per case): the largest differences
of log-probs, entropies and gradients (averaged over the ranks, as FSDP reduces them), and the patch rows that
entered ``patch_embed`` in each tower call. ``shuffled``: the plugin's gather returns the ranks' blocks in reverse
order (the negative control). Qwen3.5's gated delta-net layers run under SP too (``qwen3_5_packed_delta_net``).

CPU stand-ins: ``verl_qwen3vl_plugin.selftest.ulysses`` (the package's testing code) names them.
"""

import json
import sys

import torch
from seeded_pass import averaged_grads, seeded_pass  # tests/_child, on every child's PYTHONPATH
from ulysses_ranks import boundary_inside_image, shard  # tests/_child, on every child's PYTHONPATH

from verl_qwen3vl_plugin import originals
from verl_qwen3vl_plugin.selftest.ranks import on_two_ranks
from verl_qwen3vl_plugin.selftest.ulysses import build_model, install_cpu_stand_ins, micro_batch

# A micro-batch per case: each sample's images as (t, h, w) grids, videos marked "v"; every tensor is seeded.
CASES = {
    "mixed": [[(1, 4, 6)], [(1, 2, 2), (1, 8, 8)], [(1, 4, 4)]],  # SP boundary inside the 8 x 8 image
    "fewer_images": [[(1, 4, 4)], []],
    "large": [[(1, 2, 2)], [(1, 16, 16), (1, 2, 4)], [(1, 4, 2)]],
    "video": [[("v", 2, 4, 4)], [(1, 4, 4)]],
    "text_only": [[], []],
}


def run_pass(model, batch, sp, counts):
    """verl's forward at ``sp``, then the loss's backward: (log-probs, entropies, grads averaged as FSDP does, rows)."""
    counts.clear()
    log_probs, entropy = seeded_pass(model, batch, sp)
    grads = averaged_grads(model, sp)
    return log_probs, entropy, grads, list(counts)


def run_rank(rank, kind, cases, fsdp, shuffled):
    import verl  # noqa: F401  (the plugin activates here, as in a user's worker)
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    from verl_qwen3vl_plugin import patch_statuses
    from verl_qwen3vl_plugin.patches.qwen3_vl_vision_dp import replacement as vision_dp

    install_cpu_stand_ins()
    if shuffled:
        gather = vision_dp.gather_rows

        def reversed_gather(local, rows, rank, group):
            blocks = gather(local, rows, rank, group).split(rows)
            return torch.cat(blocks[::-1])

        vision_dp.gather_rows = reversed_gather
    model = build_model(kind)
    apply_monkey_patch(model, ulysses_sp_size=2, use_remove_padding=True, use_fused_kernels=False)  # once: it wraps
    if fsdp != "none":
        shard(model, offload=fsdp == "fsdp2_offload")
    counts = []
    model.model.visual.patch_embed.register_forward_pre_hook(lambda _, a: counts.append(a[0].shape[0]))
    applied = any(s.patch == "qwen3_vl_vision_dp" and s.status == "applied" for s in patch_statuses())
    results = {
        "rank": rank,
        "vision_dp_applied": applied,
        "tower_is_ours": originals.ours(type(model.model.visual).forward),
    }
    for case in cases.split(","):
        batch = micro_batch(CASES[case])
        ref_lp, ref_ent, ref_grads, ref_counts = run_pass(model, batch, 1, counts)
        lp, ent, grads, sp_counts = run_pass(model, batch, 2, counts)
        grad_err = max(float((grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-12)) for n, g in ref_grads.items())
        results[case] = {
            "log_prob_diff": float((lp - ref_lp).abs().max()),
            "entropy_diff": float((ent - ref_ent).abs().max()),
            "grad_rel_diff": grad_err,
            "sp1_patch_rows": ref_counts,
            "sp2_patch_rows": sp_counts,
            "boundary_inside_image": boundary_inside_image(batch, 2),
        }
    return results


if __name__ == "__main__":
    kind, cases, fsdp, *rest = sys.argv[1:]
    print(json.dumps(on_two_ranks(run_rank, kind, cases, fsdp, rest == ["shuffled"])))
