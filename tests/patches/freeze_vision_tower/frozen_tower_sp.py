"""A frozen vision tower under Ulysses SP = 2 on two FSDP2 ranks (gloo): verl's own forward (0.7.x's actor, the FSDP
engine's ``forward_step`` on verl >= 0.8) with the plugin's vision DP and single vision call, against SP = 1 on the
same micro-batch.

    frozen_tower_sp.py dense|moe|qwen3_5|qwen3_5_moe

The tower is frozen by the patch's own ``freeze_towers``, as the engine patch does before wrapping. Prints one JSON
list (per rank): the largest log-prob difference, the largest relative gradient difference, and the tower
parameters that got a gradient (none may).

CPU stand-ins: ``verl_qwen3vl_plugin.selftest.ulysses`` names them.
"""

import json
import sys

from seeded_pass import full, seeded_pass  # tests/_child, on every child's PYTHONPATH
from ulysses_ranks import shard  # tests/_child, on every child's PYTHONPATH

from verl_qwen3vl_plugin.selftest.ranks import on_two_ranks
from verl_qwen3vl_plugin.selftest.ulysses import build_model, install_cpu_stand_ins, micro_batch

SAMPLES = [[(1, 4, 6)], [(1, 2, 2), (1, 8, 8)], [(1, 4, 4)]]  # the SP boundary falls inside the 8 x 8 image


def run_rank(rank, kind):
    import verl  # noqa: F401  (the plugin activates here, as in a user's worker)
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    from verl_qwen3vl_plugin.patches.freeze_vision_tower.replacement import freeze_towers
    from verl_qwen3vl_plugin.patches.freeze_vision_tower.spec import TOWERS

    install_cpu_stand_ins()
    model = build_model(kind)
    apply_monkey_patch(model, ulysses_sp_size=2, use_remove_padding=True, use_fused_kernels=False)
    (tower,) = freeze_towers(model, TOWERS)
    shard(model)
    batch = micro_batch(SAMPLES)
    passes = {}
    for sp in (1, 2):
        log_probs, _ = seeded_pass(model, batch, sp)
        passes[sp] = log_probs, {n: full(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}
    (ref_lp, ref_grads), (lp, grads) = passes[1], passes[2]
    tower_ids = {id(p) for p in tower.parameters()}
    return {
        "rank": rank,
        "log_prob_diff": float((lp - ref_lp).abs().max()),
        "grad_rel_diff": max(
            float((grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-12)) for n, g in ref_grads.items()
        ),
        "tower_grads": [n for n, p in model.named_parameters() if id(p) in tower_ids and p.grad is not None],
    }


if __name__ == "__main__":
    print(json.dumps(on_two_ranks(run_rank, sys.argv[1], timeout=400, collective_timeout=120)))
