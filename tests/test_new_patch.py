"""A patch is its two folders and its line in ``patches.NAMES``. Adding one: a throwaway patch registered at run time,
on a throwaway upstream module, goes through the registry's checks, the hooks' path, the doctor and the docs generator
with nothing else edited. Retiring one: ``names_left_after_retiring``, which a patch's own test folder calls."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers import ROOT
from tests.test_registry_contract import check_spec_is_complete
from verl_qwen3vl_plugin import originals, patches, syntax
from verl_qwen3vl_plugin.doctor import patch_verdicts
from verl_qwen3vl_plugin.registry import (
    MODEL,
    Decision,
    Patch,
    Shape,
    Status,
    Target,
    Verdict,
    patch_statuses,
    unrecognized,
    watch_patches,
)

UPSTREAM, SELFTEST = "throwaway_upstream", "throwaway_selftest"
GREETS = Shape(id="greets", verdict=Verdict.APPLY)


def probe(tree: ast.Module) -> Decision:
    if syntax.find_function(tree, "greet") is None:
        return unrecognized("no greet()")
    return GREETS.decision("greet() says hello")


def apply(module: ModuleType, decision: Decision) -> None:
    originals.replace(module, "greet", lambda: f"patched ({decision.shape})")


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("generate", ROOT / "scripts" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def throwaway(tmp_path, monkeypatch) -> Patch:
    (tmp_path / f"{UPSTREAM}.py").write_text("def greet():\n    return 'hello'\n")
    (tmp_path / f"{SELFTEST}.py").write_text("def run():\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec_module = ModuleType(f"{patches.__name__}.throwaway.spec")
    spec_module.PATCH = Patch(
        name="throwaway",
        title="a patch that only exists in this test",
        group=MODEL,
        targets=(Target(module=UPSTREAM, probe=probe, apply=apply, shapes=(GREETS,)),),
        devices=None,
        why="greet() says hello.",
        how="greet() is replaced.",
        upstream=("verl#1",),
        remove_when="never: the test removes it.",
        details="What the short fields leave out.",
        selftest=SELFTEST,
    )
    monkeypatch.setitem(sys.modules, spec_module.__name__, spec_module)
    monkeypatch.setattr(patches, "NAMES", (*patches.NAMES, "throwaway"))
    yield spec_module.PATCH
    sys.modules.pop(UPSTREAM, None)


def test_registry_checks_accept_it(throwaway):
    assert patches.spec("throwaway") is throwaway and throwaway in patches.PATCHES
    check_spec_is_complete(throwaway)


def test_the_hooks_apply_it_when_its_target_is_imported(throwaway):
    watch_patches([throwaway], frozenset())
    assert importlib.import_module(UPSTREAM).greet() == "patched (greets)"
    status = next(s for s in patch_statuses() if s.patch == "throwaway")
    assert (status.status, status.verdict) == (Status.APPLIED, Verdict.APPLY)


def test_the_doctor_reports_it(throwaway):
    report, actions = patch_verdicts({"cuda": False, "npu": False}, frozenset())
    assert report["throwaway"]["targets"][UPSTREAM] == {
        "verdict": "apply",
        "shape": "greets",
        "reason": "greet() says hello",
    }
    assert not [a for a in actions if "throwaway" in a]


def test_the_generator_refuses_it_without_its_test_folder(throwaway):
    generate = _generator()
    with pytest.raises(generate.GenerationError, match="no test folder tests/patches/throwaway/"):
        generate.generated(patches.PATCHES)


def test_the_docs_generator_writes_its_index_row_section_column_and_table_row(throwaway, monkeypatch):
    generate = _generator()
    monkeypatch.setattr(generate, "has_tests", lambda name: True)
    files = {path.name: text for path, text in generate.generated(patches.PATCHES).items()}
    assert f'"throwaway",\n        "model",\n        "{UPSTREAM}"' in files["targets.py"]
    assert "## `throwaway`: a patch that only exists in this test" in files["patches.md"]
    assert "**Remove when.** never: the test removes it." in files["patches.md"]
    assert "| `throwaway_upstream` | `greets` | applies | every release |" in files["patches.md"]
    assert "What the short fields leave out." in files["patches.md"]
    assert "`throwaway` (every device)" in files["compatibility.md"]
    assert "| `throwaway`: a patch that only exists in this test | greet() says hello. |" in files["README.md"]


@pytest.mark.parametrize(
    "shapes",
    [(), (replace(GREETS, verl="<0.7"),), (GREETS, replace(GREETS, id="greets-too"))],
    ids=["none", "none_on_these_stacks", "two"],
)
def test_the_generator_refuses_a_target_without_one_shape_on_each_stack(throwaway, monkeypatch, shapes):
    """A missing (or ambiguous) expected verdict is an error, not a "?" in the docs."""
    generate = _generator()
    monkeypatch.setattr(generate, "has_tests", lambda name: True)
    unsure = replace(throwaway, targets=(replace(throwaway.targets[0], shapes=shapes),))
    with pytest.raises(generate.GenerationError, match="throwaway: throwaway_upstream: [02] declared shapes seen"):
        generate.generated((*patches.PATCHES, unsure))


def names_left_after_retiring(name: str, tmp_path: Path) -> list[str]:
    """In a copy of the tree: delete patch ``name``'s package, its test folder and its ``NAMES`` line, and
    regenerate (the docs, and the index of ``upstream/``, which drops the patch's staged pull request). Returns the
    files that still name it, CHANGELOG aside; ``generate.py --check`` and ``ruff check`` must pass there. Each patch
    that can be retired alone calls this from its own test folder (which the retirement deletes with the rest)."""
    tree = tmp_path / "tree"
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for file in files.split():
        if (ROOT / file).is_file():
            (tree / file).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / file, tree / file)
    shutil.rmtree(tree / "verl_qwen3vl_plugin" / "patches" / name)
    shutil.rmtree(tree / "tests" / "patches" / name)
    names = tree / "verl_qwen3vl_plugin" / "patches" / "__init__.py"
    names.write_text(re.sub(rf'^    "{name}",\n', "", names.read_text(), flags=re.M))
    env = {**os.environ, "VERL_QWEN3VL_PLUGIN_AUTOLOAD": "0", "PYTHONPATH": str(tree)}
    for args in (["scripts/generate.py"], ["scripts/generate.py", "--check"], ["scripts/upstream.py", "--index"]):
        proc = subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=tree, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return sorted(
        str(path.relative_to(tree))
        for path in tree.rglob("*")
        if path.is_file() and path.name != "CHANGELOG.md" and name in path.read_text(errors="ignore")
    )
