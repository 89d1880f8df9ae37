"""Benchmark: what the start-up hook adds to every Python process of the environment where the plugin is installed.

Fresh interpreters, outside the checkout (so the installed files are measured), alternating two arms in one sitting:
the interpreter's ordinary start with the hook, and the same start with ``site`` skipping the hook's ``.pth``. Both
arms run ``python -S`` and then ``site.main()`` themselves, with the same code; only the skipped file differs. So the
baseline is this very environment (its other ``.pth`` files, its ``sys.path``) without the plugin's hook, and the
difference is the hook alone. Each start is timed three ways: ``site.main()`` inside the child (little noise), its CPU
time (less sensitive to a busy machine), and the whole process start, fork and exec included (what a user waits for).

    python benchmarks/startup_cost.py [--runs 200]
    python benchmarks/startup_cost.py --smoke   # one start per arm: runs, no result

The budget: at most 300 us per interpreter start (docs/performance.md).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

PTH = "verl_qwen3vl_plugin_autoload.pth"
# The same code in both arms; argv[1] names the .pth file that site skips ("" skips none).
CHILD = """
import sys, time
t, cpu = time.perf_counter_ns(), time.process_time_ns()
import site
add = site.addpackage
site.addpackage = lambda sitedir, name, known: known if name == sys.argv[1] else add(sitedir, name, known)
site.main()
print(time.perf_counter_ns() - t, time.process_time_ns() - cpu, "verl_qwen3vl_plugin_autoload" in sys.modules)
"""


def start(skip: str, cwd: str) -> tuple[float, float, float, bool]:
    """One interpreter start: (whole start, site.main(), site.main()'s CPU time, all in us; whether the hook ran)."""
    t = time.perf_counter_ns()
    proc = subprocess.run([sys.executable, "-S", "-c", CHILD, skip], cwd=cwd, capture_output=True, text=True)
    wall = (time.perf_counter_ns() - t) / 1e3
    site_ns, cpu_ns, hooked = proc.stdout.split()
    return wall, int(site_ns) / 1e3, int(cpu_ns) / 1e3, hooked == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200, help="interpreter starts per arm")
    parser.add_argument("--smoke", action="store_true", help="one start per arm")
    args = parser.parse_args()
    if args.smoke:
        args.runs = 1
        print("SMOKE RUN (smallest sizes, one repeat): it checks that the benchmark runs; its times are no result")
    arms = {"with the hook": "", "without": PTH}
    runs: dict[str, list[tuple[float, float, float, bool]]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as outside:
        for skip in arms.values():  # warm-up: file-system caches, bytecode
            start(skip, outside)
        for i in range(args.runs):
            for arm in list(arms)[:: 1 if i % 2 else -1]:  # alternate which arm goes first
                runs[arm].append(start(arms[arm], outside))
    assert all(hooked for *_, hooked in runs["with the hook"]), f"{PTH} is not installed in this environment"
    assert not any(hooked for *_, hooked in runs["without"])
    print(f"{sys.executable}: {args.runs} interpreter starts per arm, alternating; medians, and the median of the")
    print("differences within each pair of starts (which cancels a load that drifts); budget +300 us")
    columns = ((1, "site.main() in the child"), (2, "its CPU time"), (0, "whole start (fork, exec, init)"))
    for column, what in columns:
        hook, base = (statistics.median(run[column] for run in runs[arm]) for arm in arms)
        paired = statistics.median(h[column] - b[column] for h, b in zip(*runs.values(), strict=True))
        line = f"{hook:6.0f} us with the hook, {base:6.0f} without, x{hook / base:.3f}; difference {paired:+4.0f} us"
        print(f"  {what:30} {line}")


if __name__ == "__main__":
    main()
