"""``verl-qwen3vl-plugin doctor --selftest``: each patch checked on embedded tiny models on the CPU, against the
upstream implementations installed here. Takes seconds; needs no accelerator and no download.

Each patch's ``selftest`` module holds its checks, with their tolerances; the test suite calls the same check
functions, on more cases. The tiny models and the CPU reference ``torch_npu`` ops live here too, so an installed
wheel can run the self-test; they are never used in training. What no self-test runs, and only the tests and
benchmarks use, lives in ``tests/`` instead, out of the wheel.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from typing import NamedTuple


class Check(NamedTuple):
    name: str
    ok: bool
    detail: str


MISSING_MODULE = re.compile(r"^ModuleNotFoundError: No module named '([\w.]+)'$")


def needs(error: str) -> str | None:
    """What the user must install, where ``error`` (a traceback or one exception line) ends in a
    ``ModuleNotFoundError`` for a top-level package that is not installed here: a self-test that cannot run says so
    instead of ending in a traceback. Anything else (a missing submodule of an installed package, a chained error)
    is None: the failure is reported as it is."""
    lines = error.strip().splitlines()
    found = MISSING_MODULE.match(lines[-1].strip()) if lines else None
    if found is None:
        return None
    top = found.group(1).split(".")[0]
    if importlib.util.find_spec(top) is not None:
        return None
    return f"needs the Python module {top!r}, not installed here: install the package that provides it, then rerun"


def in_child(module: str, name: str, drop: tuple[str, ...] = ()) -> list[Check]:
    """``python -m module``'s checks (it prints them as one JSON list), for checks that rewire upstream modules for
    the rest of their process. The child installs the hooks itself: no plugin switch, nor the names in ``drop``,
    reaches it. A child that fails is one failed check named ``name``."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_MODULES", *drop)}
    env.update(VERL_USE_EXTERNAL_PLUGINS="none", VERL_QWEN3VL_PLUGIN_AUTOLOAD="0")
    proc = subprocess.run([sys.executable, "-m", module], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        error = proc.stderr.strip()
        return [Check(name, False, needs(error) or f"child process failed: {error[-2000:]}")]
    return [Check(*c) for c in json.loads(proc.stdout.strip().splitlines()[-1])]


def run() -> list[Check]:
    """Every patch's checks, in registry order."""
    from verl_qwen3vl_plugin.patches import PATCHES

    checks = []
    for module in dict.fromkeys(patch.selftest for patch in PATCHES):  # a module may serve several patches
        try:
            checks += importlib.import_module(module).run()
        except Exception as exc:  # report, don't crash: the doctor runs on broken stacks too
            error = f"{type(exc).__name__}: {exc}"
            checks.append(Check(f"{module} self-test", False, needs(error) or error))
    return checks
