"""Peak memory of one call on the CPU, for the benchmarks beside this file: the resident-set high-water mark
(``VmHWM``, reset through ``/proc/self/clear_refs``) minus the resident set before the call, measured in a fresh
process of its own (``in_child``) so that what an earlier call freed to the allocator cannot hide a peak."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def growth(call: Callable[[], Any]) -> tuple[int, Any]:
    """(bytes the resident set grew to at its peak during ``call()``, what ``call()`` returned)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    before = _status_kb("VmRSS")
    result = call()
    return (_status_kb("VmHWM") - before) * 1024, result


def in_child(script: str, payload: list, *args: str, threads: int = 1, timeout: float = 3600) -> float:
    """The number ``script --memory-child <payload as JSON> *args`` prints last, run with ``threads`` threads."""
    command = [sys.executable, script, *args, "--memory-child", json.dumps(payload)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return float(proc.stdout.strip().splitlines()[-1])
