"""Adding a patch is one spec module, its name in ``patches.NAMES``, its replacement, its self-test and its tests.
A throwaway patch registered at run time, on a throwaway upstream module, goes through the registry's checks, the
hooks' path, the doctor and the docs generator with nothing else edited."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from types import ModuleType

import pytest

from tests.helpers import ROOT
from tests.test_registry_contract import check_spec_is_complete
from verl_qwen3vl_plugin import originals, patches, syntax
from verl_qwen3vl_plugin.doctor import patch_verdicts
from verl_qwen3vl_plugin.registry import MODEL, Decision, Patch, Status, Target, Verdict, patch_statuses, watch_patches

UPSTREAM, SELFTEST = "throwaway_upstream", "throwaway_selftest"


def decide(tree: ast.Module) -> Decision:
    if syntax.find_function(tree, "greet") is None:
        return Decision(Verdict.UNRECOGNIZED, "no-greet", "no greet()")
    return Decision(Verdict.APPLY, "greets", "greet() says hello")


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
        targets=(Target(module=UPSTREAM, decide=decide, apply=apply),),
        devices=None,
        why="greet() says hello.",
        how="greet() is replaced.",
        upstream=("verl#1",),
        remove_when="never: the test removes it.",
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


def test_the_docs_generator_writes_its_index_row_section_column_and_table_row(throwaway):
    generate = _generator()
    files = {path.name: text for path, text in generate.generated(patches.PATCHES).items()}
    assert f'"throwaway",\n        "model",\n        "{UPSTREAM}"' in files["targets.py"]
    assert "## `throwaway`: a patch that only exists in this test" in files["patches.md"]
    assert "**Remove when.** never: the test removes it." in files["patches.md"]
    assert "`throwaway` (every device)" in files["compatibility.md"]
    assert "| `throwaway`: a patch that only exists in this test | greet() says hello. |" in files["README.md"]
