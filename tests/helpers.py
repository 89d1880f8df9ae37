"""Helpers shared by the tests: the stack under test, and fresh interpreters with controlled environments.

A patch's child scripts live in its test folder, the shared ones in ``tests/_child/``, which every child has on its
``PYTHONPATH`` (``from ulysses_ranks import shard``). They are scripts, not ``tests.`` modules: verl's wheel installs
a top-level ``tests`` package of its own, which shadows this repository's outside pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from verl_qwen3vl_plugin import environment
from verl_qwen3vl_plugin.environment import MISSING, Source, dist_version, parse, verl_discovers_plugins
from verl_qwen3vl_plugin.families import QWEN3_5, QWEN3_VL
from verl_qwen3vl_plugin.patches import spec
from verl_qwen3vl_plugin.registry import Decision, Patch, Target, Verdict, decide

VERL = dist_version("verl")
TRANSFORMERS = dist_version("transformers")
DISCOVERS_PLUGINS = verl_discovers_plugins()
# Whether this transformers' Qwen3-VL tower calls fast_pos_embed_interpolate, as the patch's shapes declare.
POS_EMBED_USED = (
    spec("qwen3_vl_pos_embed").target(QWEN3_VL.modeling).shape_on(VERL.release, TRANSFORMERS.release).verdict
    is Verdict.APPLY
)
QWEN3_5_SHIPPED = QWEN3_5.shipped_by(TRANSFORMERS.release)  # transformers has the Qwen3.5 models
QWEN3_5_TRAINED = QWEN3_5.trained_by(VERL.release, TRANSFORMERS.release)  # and verl trains them
CHILD = Path(__file__).resolve().parent / "_child"
ROOT = CHILD.parents[1]
PLUGIN_SWITCHES = ("VERL_USE_EXTERNAL", "VERL_QWEN3VL_PLUGIN")


def run_args(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 300, cwd: Path | str | None = None
) -> subprocess.CompletedProcess:
    """Run this interpreter with ``args``, in this environment minus every plugin switch, plus ``env``.

    Without the switches the child is a user's process: the start-up hook on, nothing exported.
    """
    base = {k: v for k, v in os.environ.items() if not k.startswith(PLUGIN_SWITCHES)}
    base["PYTHONPATH"] = os.pathsep.join(p for p in (str(CHILD), base.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, *args], env={**base, **(env or {})}, capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


def run_child(
    script: str | Path, *args: str, env: dict[str, str] | None = None, **kwargs
) -> subprocess.CompletedProcess:
    """Run ``script`` (a path, or a name in ``tests/_child/``) in a fresh interpreter (see ``run_args`` for its
    environment)."""
    return run_args([str(CHILD / script), *args], env, **kwargs)


def last_json(proc: subprocess.CompletedProcess):
    """The JSON object a child printed last; fails with its stderr when it did not exit 0."""
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child_json(script: str | Path, *args: str, env: dict[str, str] | None = None, **kwargs):
    return last_json(run_child(script, *args, env=env, **kwargs))


def source_text(module: str) -> str | None:
    """The installed module's source text (None where it is not installed): the base the tests edit."""
    path = environment.module_path(module)
    return path.read_text(encoding="utf-8") if path is not None else None


def decide_text(patch: Patch, target: Target, text: str | None) -> Decision:
    """What the hooks decide when ``text`` is the target's source (None: the module is not installed)."""
    return decide(patch, target, parse(text) if text is not None else Source(None, MISSING), frozenset())


def use_sources(monkeypatch, sources: dict[str, str | None]) -> None:
    """Make the probes read ``sources`` (module -> text, None: not installed) instead of the installed modules."""
    real = environment.source_of

    def source_of(name: str) -> Source:
        if name not in sources:
            return real(name)
        return parse(sources[name]) if sources[name] is not None else Source(None, MISSING)

    monkeypatch.setattr(environment, "source_of", source_of)
