"""The committed ``upstream/`` is what ``scripts/upstream.py`` generates from the patches' stagings, as
``scripts/generate.py --check`` holds the docs to the specs. Generation only: no venv, no proof (``nox -s upstream``
proves the staged pull requests). It needs each base's sdist, downloaded once into the gitignored ``.upstream-work/``,
and is skipped where the download fails (no index reachable)."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("upstream_script", ROOT / "scripts" / "upstream.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_upstream_is_what_generation_writes():
    script = _script()
    for _, staging in script.stagings():
        try:
            script.sdist(staging.base)
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"pip could not download the sdist of {staging.base} (exit {exc.returncode})")
    stale = [str(path.relative_to(ROOT)) for path in script.stale(script.generated())]
    assert stale == [], "out of date: run python scripts/upstream.py"


def test_staged_tests_do_not_import_the_plugin():
    """Each staged test runs in upstream's CI, where the plugin is not installed."""
    script = _script()
    for _, staging in script.stagings():
        for test in staging.tests:
            imported = script.bindings(ast.parse((ROOT / test.source).read_text()).body).values()
            assert not [p for p in imported if p.split(".")[0] in ("verl_qwen3vl_plugin", "tests")], test.source
