"""verl 0.7.x's real ``DataParallelPPOActor`` with ``use_dynamic_bsz`` on two FSDP2 ranks (gloo) whose batches differ
in length: rank 0 holds large images (long sequences), rank 1 small ones.

    dynamic_batch_actor.py [COLLECTIVE_TIMEOUT_S WALL_TIMEOUT_S]

On each rank: ``compute_log_prob`` and ``update_policy`` with dynamic batching, then ``compute_log_prob`` with fixed
micro-batches of 2 on the same weights. Prints one JSON list (per rank): the micro-batches each call made (counted
at ``_forward_micro_batch``), and the largest difference between the dynamic and the fixed log-probs. The optimizer
has learning rate 0, so the weights stay as they are. A rank that fails reports ``{"error": ...}``; the group's
timeout and the wall-clock limit bound a hang.

CPU stand-ins: ``verl_qwen3vl_plugin.selftest.ulysses`` names them.
"""

import json
import sys

import torch
from ulysses_ranks import shard  # tests/_child, on every child's PYTHONPATH

from verl_qwen3vl_plugin.patches.dp_actor_dynamic_batch_sync.selftest import MAX_TOKENS, batch_of
from verl_qwen3vl_plugin.selftest.ranks import on_two_ranks
from verl_qwen3vl_plugin.selftest.ulysses import actor_for, build_model, install_cpu_stand_ins


def run_rank(rank):
    import verl  # noqa: F401  (the plugin activates here, as in a user's worker)
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    from verl_qwen3vl_plugin import patch_statuses

    install_cpu_stand_ins()
    model = build_model("dense")
    apply_monkey_patch(model, ulysses_sp_size=1, use_remove_padding=True, use_fused_kernels=False)
    shard(model)
    bsz, response = batch_of(rank).batch["responses"].shape

    def data(dynamic: bool, **extra):
        batch = batch_of(rank)
        batch.batch["response_mask"] = torch.ones_like(batch.batch["responses"])
        for key, value in extra.items():
            batch.batch[key] = value
        meta = {"micro_batch_size": 2, "temperature": 1.0, "use_dynamic_bsz": dynamic, "max_token_len": MAX_TOKENS}
        batch.meta_info.update(meta, pad_token_id=0)
        return batch

    counts = []

    def counting(actor):
        forward = actor._forward_micro_batch

        def counted(*args, **kwargs):
            counts[-1] += 1
            return forward(*args, **kwargs)

        actor._forward_micro_batch = counted
        return actor

    def log_probs(actor, dynamic):
        counts.append(0)
        out = actor.compute_log_prob(data(dynamic), calculate_entropy=False)
        return out["log_probs"] if isinstance(out, dict) else out[0]  # 0.7.0: (log_probs, entropys)

    extra = dict(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=MAX_TOKENS, ppo_mini_batch_size=bsz)
    actor = counting(actor_for(model, 1, **extra))
    dynamic = log_probs(actor, True)
    counts.append(0)
    advantages = torch.randn(bsz, response, generator=torch.Generator().manual_seed(2))
    actor.update_policy(data(True, old_log_probs=dynamic, advantages=advantages))
    fixed = log_probs(counting(actor_for(model, 1, ppo_mini_batch_size=bsz)), False)
    return {
        "rank": rank,
        "micro_batches": dict(zip(["compute_log_prob", "update_policy", "fixed"], counts, strict=True)),
        "log_prob_diff": float((dynamic - fixed).abs().max()),
        "statuses": {f"{s.patch} {s.target}": s.status.value for s in patch_statuses()},
    }


if __name__ == "__main__":
    collective, wall = (float(x) for x in sys.argv[1:]) if sys.argv[1:] else (300.0, 600.0)
    print(json.dumps(on_two_ranks(run_rank, timeout=wall, collective_timeout=collective)))
