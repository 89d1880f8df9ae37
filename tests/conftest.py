"""Shared test set-up.

The pytest process itself never loads the plugin through verl (VERL_USE_EXTERNAL_PLUGINS=none, no
VERL_USE_EXTERNAL_MODULES): upstream implementations are captured unpatched here, and every test of the hooks runs in
a fresh subprocess with the environment it states.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

os.environ["VERL_USE_EXTERNAL_PLUGINS"] = "none"
os.environ.pop("VERL_USE_EXTERNAL_MODULES", None)
os.environ.pop("VERL_QWEN3VL_PLUGIN_DISABLE", None)

import pytest  # noqa: E402
from packaging.version import Version  # noqa: E402

from verl_qwen3vl_plugin.compat import dist_version  # noqa: E402
from verl_qwen3vl_plugin.hooks import HOOK_MODULES  # noqa: E402

VERL = dist_version("verl")
TRANSFORMERS = dist_version("transformers")
DISCOVERS_PLUGINS = VERL >= Version("0.9")
ACTIVATE = {"VERL_USE_EXTERNAL_MODULES": ",".join(HOOK_MODULES)}


def run_args(args: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run this interpreter with ``args``, in this environment minus the plugin switches, plus ``env``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("VERL_USE_EXTERNAL", "VERL_QWEN3VL_PLUGIN"))}
    return subprocess.run(
        [sys.executable, *args], env={**base, **(env or {})}, capture_output=True, text=True, timeout=timeout
    )


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (see ``run_args`` for its environment)."""
    return run_args(["-c", textwrap.dedent(code)], env, timeout)


def run_json(code: str, env: dict[str, str] | None = None) -> dict:
    """Run ``code`` (which prints one JSON object last) in a fresh interpreter and return that object."""
    proc = run_python(code, env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def activation() -> dict[str, str]:
    """The environment that makes ``import verl`` load the plugin on this verl (nothing on verl >= 0.9)."""
    return {} if DISCOVERS_PLUGINS else dict(ACTIVATE)
