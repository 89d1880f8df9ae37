"""Benchmark: what the start-up hook adds to every Python process of the environment where the plugin is installed.

``python -X importtime -c pass`` in fresh processes, outside the checkout (so the installed files are measured):
the cumulative import time of ``verl_qwen3vl_plugin_autoload``, everything it imports included. Run it on a regular
install (``nox -s bench``); docs/performance.md has the figures, against a 1 ms budget.

    python benchmarks/startup_cost.py [--runs 21]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile

STARTUP = "verl_qwen3vl_plugin_autoload"


def importtime_us(cwd: str) -> int:
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], cwd=cwd, capture_output=True, text=True)
    (line,) = [line for line in proc.stderr.splitlines() if line.split("|")[-1].strip() == STARTUP]
    return int(line.split("|")[1])  # "import time: self | cumulative | name"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as outside:
        runs = [importtime_us(outside) for _ in range(args.runs)]
    print(f"start-up hook: {statistics.median(runs):.0f} us cumulative import time (median of {args.runs})")


if __name__ == "__main__":
    main()
