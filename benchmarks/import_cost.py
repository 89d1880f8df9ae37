"""What the plugin adds to ``import verl``: the time to load its two entry points after verl is imported.

``python -X importtime`` misses modules that verl loads through ``importlib`` (entry points), so this times the same
loads directly, in fresh processes: ``import verl`` with discovery and the start-up hook off, then
``EntryPoint.load()`` for the plugin's entry points, as verl >= 0.9 does at ``import verl``.

    python benchmarks/import_cost.py [--runs 9]
    python benchmarks/import_cost.py --smoke   # one process: runs, no result

The budget: at most 10 ms and 15 modules added to ``import verl`` (a regular, non-editable install: an editable one
adds its path hooks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = """
import json, sys, time
t0 = time.perf_counter()
import verl
t1 = time.perf_counter()
before = set(sys.modules)
from importlib.metadata import entry_points
eps = [ep for ep in entry_points(group="verl.plugins") if ep.value.startswith("verl_qwen3vl_plugin.")]
t2 = time.perf_counter()
for ep in eps:
    ep.load()
t3 = time.perf_counter()
added = sorted(set(sys.modules) - before)
print(json.dumps({"import_verl": t1 - t0, "find_entry_points": t2 - t1, "load_hooks": t3 - t2, "hooks": len(eps),
                  "modules": added}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--smoke", action="store_true", help="one fresh process")
    args = parser.parse_args()
    if args.smoke:
        args.runs = 1
        print("SMOKE RUN (smallest sizes, one repeat): it checks that the benchmark runs; its times are no result")
    # The start-up hook off too: on a verl without discovery it would load the plugin inside ``import verl``.
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_QWEN3VL_PLUGIN_AUTOLOAD": "0"}
    env.pop("VERL_USE_EXTERNAL_MODULES", None)
    runs = []
    for _ in range(args.runs):
        proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert all(r["hooks"] == 2 for r in runs), "the plugin's two entry points are not installed"
    median = {k: statistics.median(r[k] for r in runs) for k in ("import_verl", "find_entry_points", "load_hooks")}
    print(f"fresh processes: {args.runs}; medians:")
    print(f"  import verl (discovery off)      {median['import_verl'] * 1e3:8.1f} ms")
    print(f"  load the plugin's 2 entry points {median['load_hooks'] * 1e3:8.2f} ms  <- what the plugin adds")
    print(f"  (verl's own entry-point lookup   {median['find_entry_points'] * 1e3:8.2f} ms, paid with or without it)")
    modules = runs[-1]["modules"]
    print(f"  modules the plugin adds: {len(modules)}: {', '.join(modules)}")


if __name__ == "__main__":
    main()
