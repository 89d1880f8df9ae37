"""Benchmark: the plugin's ``fast_pos_embed_interpolate`` against verl's in-tree version and transformers' own method,
measured in the same run (run it on a stack that has both: verl 0.8.0 + transformers 5.3.0, ``nox -s bench``).

Every figure is a ratio against an upstream implementation timed in the same process: implementations alternate
within each repeat, and each time is the median of ``--repeats`` runs. Peak memory is measured separately, one call
per fresh process: the resident-set high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``) minus the
resident set before the call, less the output itself, relative to the output's size.

    python benchmarks/pos_embed.py [--repeats 3] [--threads 1] [--plot docs/performance.png] [--json results.json]
    python benchmarks/pos_embed.py --family qwen3_5   # a Qwen3.5 tower, against Qwen3.5's verl and transformers copies
    python benchmarks/pos_embed.py --sweep-steps 16 17 18 19    # the step-size study
    python benchmarks/pos_embed.py --smoke   # 16 images at hidden 16, one repeat, one memory case: runs, no result
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import torch
from resident_memory import growth, in_child  # benchmarks/resident_memory.py, beside this script

CASES = {
    "16 images": lambda: geo3k_like(16),
    "64 images": lambda: geo3k_like(64),
    "256 images": lambda: geo3k_like(256),
    "4 videos 16x32x32": lambda: [[16, 32, 32]] * 4,
    "1 image 128x128": lambda: [[1, 128, 128]],
}
PLOT_IMAGES = (4, 16, 64, 256)
FAMILY = "qwen3_vl"  # the tower and upstream copies measured: qwen3_vl, or qwen3_5 (--family)


def geo3k_like(n: int, seed: int = 0) -> list[list[int]]:
    """geo3k figures are a few hundred pixels a side: patch grids of 16..64 (even) per side."""
    rng = random.Random(seed)
    return [[1, 2 * rng.randint(8, 32), 2 * rng.randint(8, 32)] for _ in range(n)]


def implementations() -> dict[str, Callable]:
    from verl_qwen3vl_plugin.patches.qwen3_vl_pos_embed.replacement import fast_pos_embed_interpolate
    from verl_qwen3vl_plugin.patches.qwen3_vl_pos_embed.selftest import references

    return {"plugin": fast_pos_embed_interpolate, **references(FAMILY)}


def tower(hidden: int, dtype: torch.dtype):
    from verl_qwen3vl_plugin.selftest.tiny_models import vision_tower

    return vision_tower(hidden=hidden, dtype=dtype, family=FAMILY)


def run_once(fn: Callable, model, grid: torch.Tensor, backward: bool, grad_out: torch.Tensor | None) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    if backward:
        fn(model, grid).backward(grad_out)
    else:
        with torch.no_grad():
            fn(model, grid)
    return time.perf_counter() - start


def time_case(impls: dict[str, Callable], grid_rows, hidden, dtype, backward, repeats) -> dict[str, float]:
    model, grid = tower(hidden, dtype), torch.tensor(grid_rows)
    rows = int(grid.prod(-1).sum())
    grad_out = torch.randn(rows, hidden, dtype=dtype) if backward else None
    times: dict[str, list[float]] = {name: [] for name in impls}
    for fn in impls.values():  # warm-up (caches, lazy init)
        run_once(fn, model, grid, backward, grad_out)
    for _ in range(repeats):
        for name, fn in impls.items():
            times[name].append(run_once(fn, model, grid, backward, grad_out))
    return {name: statistics.median(ts) for name, ts in times.items()}


def peak_memory_child(impl: str, case: str, hidden: int, dtype: str, backward: bool) -> float:
    """In a fresh process: (peak resident growth during one call - output bytes) / output bytes."""
    fn = implementations()[impl]
    model, grid = tower(hidden, getattr(torch, dtype)), torch.tensor(CASES[case]())
    rows = int(grid.prod(-1).sum())
    out_bytes = rows * hidden * model.pos_embed.weight.element_size()
    grad_out = torch.randn(rows, hidden, dtype=getattr(torch, dtype)) if backward else None
    # Warm up on one tiny image: the kernels' code pages and the plugin's grid tables then count as resident
    # before the measurement (at hidden 16 they would otherwise outweigh the output).
    tiny = torch.tensor([[1, 2, 2]])
    run_once(fn, model, tiny, backward, torch.zeros(4, hidden, dtype=getattr(torch, dtype)) if backward else None)
    grown, _ = growth(lambda: run_once(fn, model, grid, backward, grad_out))
    return (grown - out_bytes) / out_bytes


def peak_memory(impl: str, case: str, hidden: int, dtype: str, backward: bool, threads: int) -> float:
    return in_child(__file__, [impl, case, hidden, dtype, backward], "--family", FAMILY, threads=threads, timeout=1800)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--plot", help="write a PNG of time against number of images")
    parser.add_argument("--json", help="write all measurements as JSON")
    parser.add_argument("--case", action="append", choices=list(CASES), help="only these cases (repeatable)")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument(
        "--sweep-steps", type=int, nargs="+", metavar="LOG2",
        help="instead: time the plugin's forward in steps of 2^LOG2 elements each, against verl, alternating",
    )  # fmt: skip
    parser.add_argument("--family", choices=["qwen3_vl", "qwen3_5"], default="qwen3_vl")
    parser.add_argument("--smoke", action="store_true", help="16 images at hidden 16, one repeat, one memory case")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    global FAMILY
    FAMILY = args.family
    torch.set_num_threads(args.threads)
    if args.memory_child:
        print(peak_memory_child(*json.loads(args.memory_child)))
        return

    impls = implementations()
    hiddens, memory_case, memory_runs, plot_images = (1152, 16), "64 images", None, PLOT_IMAGES
    if args.smoke:
        args.repeats, args.case = 1, args.case or ["16 images"]
        hiddens, memory_case, memory_runs, plot_images = (16,), "16 images", 1, PLOT_IMAGES[:2]
        print("SMOKE RUN (smallest sizes, one repeat): it checks that the benchmark runs; its times are no result")
    if args.sweep_steps:
        sweep_steps(impls, args.sweep_steps, args.repeats)
        return
    upstream = [name for name in impls if name != "plugin"]
    capability = torch.backends.cpu.get_cpu_capability()
    print(f"{FAMILY} tower; torch {torch.__version__}, {args.threads} thread(s), CPU {capability}", end="")
    print(f", median of {args.repeats}")
    print(f"ratios: upstream time / plugin time, upstream = {', '.join(upstream)}")
    header = f"{'case':20} {'hidden':>6} {'dtype':9} {'pass':8} {'plugin s':>9} " + " ".join(
        f"{name + ' s':>13} {'x vs ' + name:>16}" for name in upstream
    )
    print(header)
    results = []
    for case, make in CASES.items():
        if args.case and case not in args.case:
            continue
        for hidden in hiddens:
            for dtype in (torch.float32, torch.bfloat16):
                for backward in (False, True):
                    t = time_case(impls, make(), hidden, dtype, backward, args.repeats)
                    row = dict(case=case, hidden=hidden, dtype=str(dtype)[6:], backward=backward, seconds=t)
                    results.append(row)
                    line = f"{case:20} {hidden:6} {row['dtype']:9} {'fwd+bwd' if backward else 'fwd':8} "
                    line += f"{t['plugin']:9.4f} " + " ".join(
                        f"{t[n]:13.4f} {t[n] / t['plugin']:15.1f}x" for n in upstream
                    )
                    print(line, flush=True)

    if not args.skip_memory:
        print(f"\npeak extra memory during one call, relative to the output ({memory_case}, fresh process each):")
        combinations = [(h, d, b) for h in hiddens for d in ("float32", "bfloat16") for b in (False, True)]
        for hidden, dtype, backward in combinations[:memory_runs]:
            mem = {n: peak_memory(n, memory_case, hidden, dtype, backward, args.threads) for n in impls}
            results.append(dict(case=memory_case, hidden=hidden, dtype=dtype, backward=backward, memory=mem))
            print(f"  hidden {hidden:4} {dtype:9} {'fwd+bwd' if backward else 'fwd':8} "
                  + "  ".join(f"{n}: {m:5.2f}x" for n, m in mem.items()), flush=True)  # fmt: skip

    if args.plot:
        sweep = {}
        for n in plot_images:
            sweep[n] = time_case(impls, geo3k_like(n), 1152, torch.float32, False, args.repeats)
        results.append(dict(sweep={str(n): t for n, t in sweep.items()}))
        plot(sweep, args.plot)
        print(f"\nplot: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def sweep_steps(impls: dict[str, Callable], sizes: list[int], repeats: int) -> None:
    """The step-size study: forward, fp32, geo3k-like images, ratios against verl for steps of 2^k elements."""
    from verl_qwen3vl_plugin.patches.qwen3_vl_pos_embed import replacement as qwen3_vl

    default = qwen3_vl._STEP_ELEMENTS["cpu"]
    print(f"CPU {torch.backends.cpu.get_cpu_capability()}, forward fp32, x vs verl, median of {repeats}")
    for hidden in (1152, 16):
        for images in (16, 64):
            model, grid = tower(hidden, torch.float32), torch.tensor(geo3k_like(images))
            times: dict[int | str, list[float]] = {"verl": [], **{k: [] for k in sizes}}
            for _ in range(repeats + 1):  # the first round warms up
                for key in times:
                    if key != "verl":
                        qwen3_vl._STEP_ELEMENTS["cpu"] = 1 << key
                    fn = impls["verl"] if key == "verl" else impls["plugin"]
                    times[key].append(run_once(fn, model, grid, False, None))
            qwen3_vl._STEP_ELEMENTS["cpu"] = default
            med = {key: statistics.median(ts[1:]) for key, ts in times.items()}
            ratios = "  ".join(f"2^{k}: {med['verl'] / med[k]:5.2f}x" for k in sizes)
            floor = first_write(int(grid.prod(-1).sum()), hidden, repeats)
            best = min(sizes, key=med.__getitem__)
            print(
                f"  hidden {hidden:4}, {images:2} images (verl {med['verl'] * 1e3:.1f} ms, plugin at 2^{best} "
                f"{med[best] * 1e3:.1f} ms, first write of the output {floor * 1e3:.1f} ms): {ratios}",
                flush=True,
            )


def first_write(rows: int, hidden: int, repeats: int) -> float:
    """The floor every implementation pays: allocating the output and writing it once (page faults included)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.empty(rows, hidden).fill_(0)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def plot(sweep: dict[int, dict[str, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in next(iter(sweep.values())):
        ax.plot(list(sweep), [t[name] for t in sweep.values()], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("geo3k-like images per call (16..64 patches a side)")
    ax.set_ylabel("seconds per forward (CPU, 1 thread)")
    ax.set_title("fast_pos_embed_interpolate, hidden 1152, fp32")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
