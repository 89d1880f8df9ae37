"""Benchmark: the first interpolation call on a new long thin grid size, the plugin against upstream.

The plugin caches per-grid-size tables; a size it has not seen must still cost about what upstream's call costs
(it did: within 2x on 2026-12-01, which a test used to assert on wall-clock time, see docs/performance.md). Each
figure comes from a fresh process (``tests/_child/pos_embed_first_call.py``, one thread), the implementations
alternating; medians.

    python benchmarks/pos_embed_first_call.py [--runs 5] [--widths 1024 8192]
    python benchmarks/pos_embed_first_call.py --smoke   # one run at W = 1024: runs, no result
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = Path(__file__).resolve().parents[1] / "tests" / "patches" / "qwen3_vl_pos_embed" / "pos_embed_first_call.py"


def first_calls(impl: str, widths: list[str]) -> dict[str, float]:
    proc = subprocess.run([sys.executable, str(CHILD), impl, *widths], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--widths", nargs="+", default=["1024", "8192"])
    parser.add_argument("--smoke", action="store_true", help="one run, the narrowest width")
    args = parser.parse_args()
    if args.smoke:
        args.runs, args.widths = 1, ["1024"]
        print("SMOKE RUN (smallest sizes, one repeat): it checks that the benchmark runs; its times are no result")

    from verl_qwen3vl_plugin.patches.qwen3_vl_pos_embed.selftest import references

    impls = ["plugin", *references()]
    seconds = {impl: {w: [] for w in args.widths} for impl in impls}
    for _ in range(args.runs):
        for impl in impls:
            for width, value in first_calls(impl, args.widths).items():
                seconds[impl][width].append(value)
    print(f"first call on grid [1, 2, W], hidden 16, one thread; medians of {args.runs} fresh processes each")
    print(f"{'W':>6} " + " ".join(f"{impl:>12}" for impl in impls) + "".join(f"  plugin/{r}" for r in impls[1:]))
    for width in args.widths:
        medians = {impl: statistics.median(seconds[impl][width]) for impl in impls}
        ratios = "".join(f"  {medians['plugin'] / medians[r]:>{7 + len(r)}.2f}x" for r in impls[1:])
        print(f"{width:>6} " + " ".join(f"{medians[i] * 1e3:>9.1f} ms" for i in impls) + ratios)


if __name__ == "__main__":
    main()
