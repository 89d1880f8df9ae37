"""Benchmark: ``actor.freeze_vision_tower`` honoured (the plugin) against ignored (verl's FSDP engine).

1. What the freeze saves for Qwen3-VL-30B-A3B's tower, from its config's vision numbers (no hub download here):
   fp32 AdamW state (exp_avg, exp_avg_sq) and fp32 gradients, and the bf16 bytes each weight sync sends for it.
   The tower is built on the meta device from ``CONFIG_30B_A3B`` and its parameters counted.
2. The actor step through verl's own FSDP engine (FSDP2, AdamW) on two CPU ranks, a small Qwen3-VL with a 4-block
   tower, freeze on against off, alternating runs of fresh rank processes, medians: the step's time, each process's
   peak RSS, and the AdamW state and gradient bytes a rank holds.

    python benchmarks/freeze_vision_tower.py [--images 8] [--steps 3] [--pairs 3]
    python benchmarks/freeze_vision_tower.py --smoke   # one run of each mode, one step: runs, no result
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

# Qwen/Qwen3-VL-30B-A3B-Instruct, config.json "vision_config" (huggingface.co/Qwen/Qwen3-VL-30B-A3B-Instruct, the
# same numbers as benchmarks/vision_dp.py and transformers' Qwen3VLMoeVisionConfig defaults).
CONFIG_30B_A3B = dict(
    depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16,
    temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=2048, num_position_embeddings=2304,
    deepstack_visual_indexes=[8, 16, 24],
)  # fmt: skip
BENCH_TOWER = dict(depth=4, hidden_size=128, intermediate_size=512, num_heads=4, deepstack_visual_indexes=[1])
GIB = 1024**3


def tower_30b_a3b() -> None:
    from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeVisionConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

    with torch.device("meta"):
        tower = Qwen3VLMoeVisionModel(Qwen3VLMoeVisionConfig(**CONFIG_30B_A3B))
    params = sum(p.numel() for p in tower.parameters())
    parts = {
        "blocks": sum(p.numel() for p in tower.blocks.parameters()),
        "mergers": sum(p.numel() for p in [*tower.merger.parameters(), *tower.deepstack_merger_list.parameters()]),
        "patch embedding + position table": sum(
            p.numel() for p in [*tower.patch_embed.parameters(), *tower.pos_embed.parameters()]
        ),
    }
    print(f"Qwen3-VL-30B-A3B vision tower: {params / 1e6:.1f} M parameters "
          f"({', '.join(f'{k} {v / 1e6:.1f} M' for k, v in parts.items())})")  # fmt: skip
    print(
        f"  AdamW state saved (fp32 exp_avg + exp_avg_sq, 8 B/param): {8 * params / GIB:.2f} GiB, over the FSDP group"
    )
    print(
        f"  fp32 gradients saved (4 B/param):                          {4 * params / GIB:.2f} GiB, over the FSDP group"
    )
    print(f"  bf16 bytes per weight sync that later syncs could skip:    {2 * params / GIB:.2f} GiB")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 tensor (a DTensor counts its whole size)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _rank_steps(rank: int, freeze: bool, images: int, steps: int) -> dict:
    """On one of two gloo ranks: verl's own FSDP engine (FSDP2, AdamW) for an actor with ``freeze_vision_tower``,
    built around a small Qwen3-VL; one warm-up step, then ``steps`` timed steps (forward, backward, verl's
    ``optimizer_step``). The median step, this process's peak RSS, and the optimizer-state and gradient bytes it
    holds."""
    import resource

    import verl  # noqa: F401  (the plugin activates here, as in a user's worker)
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    from verl_qwen3vl_plugin.selftest.ulysses import (
        build_model,
        built_engine,
        engine_batch,
        install_cpu_stand_ins,
        micro_batch,
    )

    install_cpu_stand_ins()
    model = build_model("dense", **BENCH_TOWER)
    apply_monkey_patch(model, ulysses_sp_size=1, use_remove_padding=True, use_fused_kernels=False)
    engine = built_engine(model, "fsdp2", freeze)
    batch = engine_batch(micro_batch([[(1, 16, 16)] * (images // 2)] * 2))

    def loss_function(model_output, data, dp_group):
        return model_output["log_probs"].values().float().pow(2).mean(), {}

    engine.module.train()
    seconds = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        engine.optimizer_zero_grad()
        loss, _ = engine.forward_step(batch, loss_function=loss_function, forward_only=False)
        loss.backward()
        engine.optimizer_step()
        seconds.append(time.perf_counter() - start)
    state = sum(_local(t).nbytes for s in engine.optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    grads = sum(_local(p.grad).nbytes for p in engine.module.parameters() if p.grad is not None)
    return {
        "seconds": statistics.median(seconds[1:]),
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "optimizer_state": state,
        "gradients": grads,
    }


def actor_step(images: int, steps: int, pairs: int) -> None:
    """Freeze on and off, alternating, each run two fresh rank processes (peak RSS is per process); medians over the
    runs of the per-run median step (rank 0; the ranks step together)."""
    from verl_qwen3vl_plugin.selftest.ranks import on_two_ranks

    runs = {"off": [], "on": []}
    for _ in range(pairs):
        for mode in runs:
            results = on_two_ranks(_rank_steps, mode == "on", images, steps, timeout=600)
            errors = [r["error"] for r in results if "error" in r]
            if errors:
                raise SystemExit(f"freeze {mode}: {errors[0]}")
            runs[mode].append(results[0])
    if pairs < 3:
        return
    median = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    off, on = median["off"], median["on"]
    print(
        f"verl's FSDP engine, FSDP2 on two CPU ranks (gloo), fp32, one actor step over {images} images of 16 x 16 "
        f"patches, {BENCH_TOWER['depth']}-block tower (hidden {BENCH_TOWER['hidden_size']}); medians of {pairs} "
        f"alternating runs of {steps} steps (rank 0):"
    )
    print("| | step | peak RSS | AdamW state | gradients |")
    print("|---|---|---|---|---|")
    for label, r in (("freeze off (verl's engine)", off), ("freeze on (plugin)", on)):
        print(f"| {label} | {r['seconds'] * 1e3:.0f} ms | {r['peak_rss'] / 2**20:.0f} MiB | "
              f"{r['optimizer_state'] / 2**20:.1f} MiB | {r['gradients'] / 2**20:.1f} MiB |")  # fmt: skip
    less = {k: (off[k] - on[k]) / 2**20 for k in ("peak_rss", "optimizer_state", "gradients")}
    print(f"| on vs off | {off['seconds'] / on['seconds']:.2f}x faster | {less['peak_rss']:.0f} MiB less | "
          f"{less['optimizer_state']:.1f} MiB less | {less['gradients']:.1f} MiB less |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=8, help="per rank")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run, after one warm-up step")
    parser.add_argument("--pairs", type=int, default=3, help="alternating runs of each mode")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    tower_30b_a3b()
    if args.smoke:
        actor_step(2, 1, 1)
    else:
        actor_step(args.images, args.steps, args.pairs)


if __name__ == "__main__":
    main()
