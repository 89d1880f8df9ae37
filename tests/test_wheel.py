"""The plugin as users get it: the wheel built by ``python -m build``, installed (not editable) in a fresh venv.

Runs only in nox's ``wheel`` session (marker ``wheel``), which builds and installs that wheel. Every check runs in a
child interpreter outside the checkout, so it sees the installed files, never the source tree.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import sysconfig
import time
from importlib import metadata
from pathlib import Path

import pytest

from tests.helpers import DISCOVERS_PLUGINS, child_json, run_args
from verl_qwen3vl_plugin.registry import HOOK_MODULES

pytestmark = pytest.mark.wheel
SITE = Path(sysconfig.get_paths()["purelib"])
PTH = SITE / "verl_qwen3vl_plugin_autoload.pth"
STARTUP = "verl_qwen3vl_plugin_autoload"
RUNS = 21
BUDGET_US = 1000  # what the start-up hook may add to any Python process


def test_regular_install_of_the_wheel():
    dist = metadata.distribution("verl-qwen3vl-plugin")
    direct_url = dist.read_text("direct_url.json")
    assert direct_url is None or not json.loads(direct_url).get("dir_info", {}).get("editable"), direct_url
    files = {str(f) for f in dist.files}
    assert {PTH.name, f"{STARTUP}.py", "verl_qwen3vl_plugin/registry.py"} <= files
    assert PTH.read_text().strip() == f"import {STARTUP}"


def test_entry_points_and_console_script():
    eps = {ep.name: ep.value for ep in metadata.entry_points(group="verl.plugins") if ep.value in HOOK_MODULES.values()}
    assert sorted(eps.values()) == sorted(HOOK_MODULES.values())
    script = Path(sys.executable).with_name("verl-qwen3vl-plugin")
    proc = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == metadata.version("verl-qwen3vl-plugin"), proc


def test_import_verl_loads_the_installed_plugin_with_no_env(tmp_path):
    result = child_json("import_verl.py", cwd=tmp_path)
    assert Path(result["plugin_file"]).is_relative_to(SITE), result["plugin_file"]
    assert result["hooks"] == sorted(HOOK_MODULES.values())
    assert result["activated_by"] == ("entry points" if DISCOVERS_PLUGINS else "start-up hook")


def _importtime_us(tmp_path: Path) -> int:
    proc = run_args(["-X", "importtime", "-c", "pass"], cwd=tmp_path)
    (line,) = [line for line in proc.stderr.splitlines() if line.rstrip().endswith(f"| {STARTUP}")]
    return int(line.split("|")[1])


def _wall_s(tmp_path: Path) -> float:
    start = time.perf_counter()
    run_args(["-c", "pass"], cwd=tmp_path)
    return time.perf_counter() - start


def test_start_up_cost_within_budget(tmp_path):
    """``python -X importtime -c pass``: the start-up module, with everything it imports, under 1 ms (median)."""
    cost = statistics.median(_importtime_us(tmp_path) for _ in range(RUNS))
    walls = {True: [], False: []}
    disabled = PTH.with_suffix(".pth.off")
    try:
        for i in range(2 * RUNS):  # alternating, for the wall-clock figure printed below
            installed = i % 2 == 0
            (disabled if installed else PTH).rename(PTH if installed else disabled)
            walls[installed].append(_wall_s(tmp_path))
    finally:
        if disabled.exists():
            disabled.rename(PTH)
    delta = statistics.median(walls[True]) - statistics.median(walls[False])
    print(f"\nstart-up hook: importtime {cost:.0f} us (median of {RUNS}); `python -c pass` wall "
          f"{statistics.median(walls[True]) * 1e3:.1f} ms with, {statistics.median(walls[False]) * 1e3:.1f} ms "
          f"without, difference {delta * 1e6:.0f} us")  # fmt: skip
    assert cost <= BUDGET_US


def test_start_up_imports_only_the_hook_module(tmp_path):
    with_hook = set(child_json("startup_modules.py", cwd=tmp_path))
    disabled = PTH.with_suffix(".pth.off")
    PTH.rename(disabled)
    try:
        without = set(child_json("startup_modules.py", cwd=tmp_path))
    finally:
        disabled.rename(PTH)
    assert with_hook - without == {STARTUP}
