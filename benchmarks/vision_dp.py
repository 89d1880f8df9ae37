"""Benchmark: the vision tower under Ulysses SP, every image on every rank (verl) against the plugin's vision DP.

1. Per-rank vision FLOPs of Qwen3-VL-30B-A3B's tower (27 blocks, hidden 1152, MLP 4304, 3 deepstack mergers),
   from the shapes, for a micro-batch of geo3k-sized images at SP 2 and SP 8: the busiest rank's share.
2. CPU time of one actor forward + backward at SP = 2 on two gloo ranks (verl's real path, the stand-ins of
   ``verl_qwen3vl_plugin.selftest.ulysses``), a small model with a 4-block tower, with and without the patch on the
   same ranks, alternating, medians of the slower rank's time (the step waits for it).

    python benchmarks/vision_dp.py [--images 16] [--repeats 5]
    python benchmarks/vision_dp.py --smoke   # 2 images, one repeat: runs, no result
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

# ``ulysses_ranks`` (tests/_child/ulysses_ranks.py) is imported from its folder, not as ``tests.``: verl's wheel
# installs a ``tests`` package of its own, which shadows this repository's outside pytest
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests" / "_child"))

# geo3k diagrams are a few hundred pixels a side: with 16-pixel patches and 2 x 2 merging, grids like these
GEO3K_GRIDS = [(1, 20, 14), (1, 16, 16), (1, 24, 18), (1, 14, 10)]
DEPTH, HIDDEN, MLP, HEADS, MERGE, OUT, DEEPSTACK = 27, 1152, 4304, 16, 2, 2048, 3
BENCH_TOWER = dict(depth=4, hidden_size=128, intermediate_size=512, num_heads=4, deepstack_visual_indexes=[1])


def tower_gflop(patches: int) -> float:
    """Forward GFLOP of the 30B-A3B tower on one image of ``patches`` patches (2 FLOPs per multiply-add)."""
    blocks = DEPTH * (2 * patches * (4 * HIDDEN**2 + 2 * HIDDEN * MLP) + 4 * patches**2 * HIDDEN)
    wide = HIDDEN * MERGE**2
    mergers = (1 + DEEPSTACK) * 2 * (patches // MERGE**2) * (wide * wide + wide * OUT)
    return (blocks + mergers) / 1e9


def flops_table(images: int) -> None:
    from verl_qwen3vl_plugin.patches.qwen3_vl_vision_dp.replacement import assign

    grids = [GEO3K_GRIDS[i % len(GEO3K_GRIDS)] for i in range(images)]
    patches = [t * h * w for t, h, w in grids]
    per_image = [3 * tower_gflop(p) for p in patches]  # forward + backward
    print(f"Qwen3-VL-30B-A3B vision tower, {images} geo3k-sized images ({sum(patches)} patches), forward + backward:")
    for sp in (2, 8):
        busiest = max(sum(per_image[s:e]) for s, e in assign(patches, sp))
        shares = [sum(patches[s:e]) for s, e in assign(patches, sp)]
        print(f"  SP {sp}: per-rank vision {sum(per_image):8.0f} GFLOP (verl) -> {busiest:7.0f} GFLOP busiest rank "
              f"(plugin), {sum(per_image) / busiest:.1f}x less; patches per rank {shares}")  # fmt: skip


def _rank(rank: int, images: int, repeats: int) -> dict[str, float]:
    """On one of the two ranks: median times of the slower rank, per implementation."""
    import verl  # noqa: F401  (the plugin activates here)
    from ulysses_ranks import log_prob_forward
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    from verl_qwen3vl_plugin import originals
    from verl_qwen3vl_plugin.selftest.ulysses import build_model, install_cpu_stand_ins, micro_batch

    install_cpu_stand_ins()
    model = build_model("dense", **BENCH_TOWER)
    apply_monkey_patch(model, ulysses_sp_size=2, use_remove_padding=True, use_fused_kernels=False)
    cls = type(model.model.visual)
    plugin = cls.forward
    forwards = {"verl": originals.original(cls, "forward"), "plugin": plugin}
    grids = [GEO3K_GRIDS[i % len(GEO3K_GRIDS)] for i in range(images)]
    batch = micro_batch([[grid] for grid in grids])
    times = {name: [] for name in forwards}
    for step in range(repeats + 1):  # the first round warms up
        for name, forward in forwards.items():
            cls.forward = forward
            model.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            log_probs, entropy = log_prob_forward(model, batch, sp=2)
            (log_probs.sum() + entropy.sum()).backward()
            elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step:
                times[name].append(float(elapsed))
    cls.forward = plugin
    return {name: statistics.median(ts) for name, ts in times.items()}


def cpu_times(images: int, repeats: int) -> dict[str, float]:
    from verl_qwen3vl_plugin.selftest.ranks import on_two_ranks

    result = on_two_ranks(_rank, images, repeats, timeout=3600)[0]
    if "error" in result:
        raise RuntimeError(result["error"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="2 images (one a rank), one repeat")
    args = parser.parse_args()
    if args.smoke:
        args.images, args.repeats = 2, 1
    flops_table(args.images)
    times = cpu_times(args.images, args.repeats)
    if args.smoke:
        print("\nSMOKE RUN (smallest sizes, one repeat): it checks that the benchmark runs; its times are no result")
    print(f"\nCPU, 2 gloo ranks x 1 thread, SP = 2, actor forward + backward, {args.images} images, tower "
          f"{json.dumps(BENCH_TOWER)}; medians of {args.repeats}, alternating:")  # fmt: skip
    print(f"  verl {times['verl']:.3f} s, plugin {times['plugin']:.3f} s: {times['verl'] / times['plugin']:.2f}x")


if __name__ == "__main__":
    main()
