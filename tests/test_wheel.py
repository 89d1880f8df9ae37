"""The plugin as users get it: the wheel built by ``python -m build``, installed (not editable).

Runs only at the end of nox's main-stack ``tests`` session (marker ``wheel``), which builds the wheel and installs it
over the editable install. Every check runs in a
child interpreter outside the checkout, so it sees the installed files, never the source tree.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import DISCOVERS_PLUGINS, child_json
from verl_qwen3vl_plugin.registry import HOOK_MODULES

pytestmark = pytest.mark.wheel
SITE = Path(sysconfig.get_paths()["purelib"])
PTH = SITE / "verl_qwen3vl_plugin_autoload.pth"
STARTUP = "verl_qwen3vl_plugin_autoload"


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict:
    return child_json("distribution.py", cwd=tmp_path_factory.mktemp("outside"))


def test_regular_install_of_the_wheel(dist):
    assert not dist["direct_url"].get("dir_info", {}).get("editable"), dist["direct_url"]
    assert {PTH.name, f"{STARTUP}.py", "verl_qwen3vl_plugin/registry.py"} <= set(dist["files"])
    assert PTH.read_text().strip() == f"import {STARTUP}"
    assert (SITE / f"{STARTUP}.py").is_file()


def test_entry_points_and_console_script(dist):
    assert sorted(dist["entry_points"].values()) == sorted(HOOK_MODULES.values())
    assert dist["scripts"] == {"verl-qwen3vl-plugin": "verl_qwen3vl_plugin.cli:main"}
    script = Path(sys.executable).with_name("verl-qwen3vl-plugin")
    proc = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == dist["version"], proc


def test_import_verl_loads_the_installed_plugin_with_no_env(tmp_path):
    result = child_json("import_verl.py", cwd=tmp_path)
    assert Path(result["plugin_file"]).is_relative_to(SITE), result["plugin_file"]
    assert result["hooks"] == sorted(HOOK_MODULES.values())
    assert result["activated_by"] == ("entry points" if DISCOVERS_PLUGINS else "start-up hook")


@contextlib.contextmanager
def _without_start_up_hook() -> Iterator[None]:
    disabled = PTH.with_suffix(".pth.off")
    PTH.rename(disabled)
    try:
        yield
    finally:
        disabled.rename(PTH)


def test_start_up_imports_only_the_hook(tmp_path):
    """The start-up module alone, and nothing else, not even the standard library modules it does not already find
    loaded: the package and its import watcher wait until verl is looked up."""
    with_hook = set(child_json("startup_modules.py", cwd=tmp_path))
    with _without_start_up_hook():
        without = set(child_json("startup_modules.py", cwd=tmp_path))
    assert with_hook - without == {STARTUP}
