"""The registry, the patch modules, the entry points and the generated files agree: a patch module must be listed in
``patches.NAMES``, its spec complete, its probes reading only what its targets declare, and the generated index and
docs up to date."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import verl_qwen3vl_plugin as plugin
from tests.helpers import ROOT, child_json
from verl_qwen3vl_plugin import environment, patches
from verl_qwen3vl_plugin.activation import STARTUP_MODULE
from verl_qwen3vl_plugin.doctor import patch_verdicts
from verl_qwen3vl_plugin.families import FAMILIES, QWEN3_VL, Family
from verl_qwen3vl_plugin.patches import NAMES, PATCHES
from verl_qwen3vl_plugin.registry import HOOK_MODULES, Patch, Verdict

PATCHES_DOC = (ROOT / "docs" / "patches.md").read_text()


def test_every_patch_package_is_listed():
    """A patch is a package, ``patches/<name>/``, whose ``spec`` module holds its ``PATCH``; no patch module lies
    outside one (``targets`` is the generated index)."""
    found = {m.name: m.ispkg for m in pkgutil.iter_modules(patches.__path__)}
    assert [name for name, ispkg in found.items() if not ispkg] == ["targets"]
    assert found, "no patch packages found"
    for name in (name for name, ispkg in found.items() if ispkg):
        module = importlib.import_module(f"{patches.__name__}.{name}.spec")
        assert isinstance(getattr(module, "PATCH", None), Patch), f"patches/{name}/spec.py defines no PATCH"
        assert module.PATCH in PATCHES, f"patches/{name}/ is not listed in patches.NAMES"


def test_names_unique():
    assert len(set(NAMES)) == len(NAMES)


@pytest.mark.parametrize("patch", PATCHES, ids=NAMES)
def test_spec_is_complete(patch: Patch):
    check_spec_is_complete(patch)


def check_spec_is_complete(patch: Patch) -> None:
    assert patch.group in HOOK_MODULES, patch.group
    for field in ("why", "how", "remove_when"):
        assert getattr(patch, field).strip(), f"{patch.name}: empty {field}"
    assert patch.upstream and all(re.fullmatch(r"(verl|transformers|vllm-ascend)#\d+", r) for r in patch.upstream)
    assert patch.targets and len({t.label for t in patch.targets}) == len(patch.targets)
    assert importlib.util.find_spec(patch.selftest) is not None, patch.selftest
    assert patch.devices is None or set(patch.devices) <= {"cuda", "npu"}


def test_docs_have_no_section_for_an_unknown_patch():
    assert set(re.findall(r"^## `([a-z0-9_]+)`", PATCHES_DOC, re.M)) == set(NAMES)


def test_entry_points_name_the_hook_modules():
    """The installed metadata, which pip builds from pyproject.toml: one entry point per hook group."""
    ours = [ep for ep in metadata.entry_points(group="verl.plugins") if ep.value.startswith("verl_qwen3vl_plugin.")]
    assert sorted(ep.value for ep in ours) == sorted(HOOK_MODULES.values())


def _ours(name: str, package: str) -> bool:
    return name == package or name.startswith(f"{package}.") or name == STARTUP_MODULE


def _imports(path: Path, package: str) -> set[str]:
    """The plugin modules ``path`` imports, at module level or inside functions (a lazy import is still an edge)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if _ours(a.name, package)}
        elif isinstance(node, ast.ImportFrom) and node.module and _ours(node.module, package):
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if importlib.util.find_spec(node.module).submodule_search_locations is not None
                          and importlib.util.find_spec(child) is not None else node.module)  # fmt: skip
    return found


def test_no_import_loop_in_what_ships():
    """Every module the wheel ships, the start-up module included: registry once imported the patches, which import
    the registry; and the start-up module imported activation, which imported registry, which imported it back."""
    root = Path(plugin.__file__).parent
    modules = {
        ".".join((plugin.__name__, *p.relative_to(root).with_suffix("").parts)).removesuffix(".__init__"): p
        for p in root.rglob("*.py")
    }
    modules[STARTUP_MODULE] = ROOT / "startup" / f"{STARTUP_MODULE}.py"
    graph = {name: _imports(path, plugin.__name__) - {name} for name, path in modules.items()}
    done: set[str] = set()

    def visit(name: str, stack: tuple[str, ...]) -> None:
        assert name not in stack, f"import loop: {' -> '.join(stack[stack.index(name) :] + (name,))}"
        if name in done or name not in graph:
            return
        for imported in graph[name]:
            visit(imported, (*stack, name))
        done.add(name)

    for name in graph:
        visit(name, ())


def test_importing_the_wheel_rebinds_no_upstream_global():
    """The CPU stand-ins (``selftest.ulysses``, ``selftest.moe_blocks``) act only when called, in the tests and in the
    self-test's own children; importing any module of the wheel leaves verl and transformers as they were."""
    result = child_json("import_every_module.py", env={"VERL_QWEN3VL_PLUGIN_DISABLE": "all"})
    assert "verl_qwen3vl_plugin.selftest.ulysses" in result["imported"]
    assert result["changed"] == []


def test_each_upstream_module_is_parsed_once_per_process(monkeypatch):
    """Three patches read ``modeling_qwen3_vl_moe``, two ``npu_patch``; every probe, hook and the doctor share one
    cache, so each source is parsed once however many verdicts read it."""
    texts = []
    real = environment.parse
    monkeypatch.setattr(environment, "parse", lambda text: texts.append(text) or real(text))
    environment.source_of.cache_clear()
    try:
        for _ in range(2):
            patch_verdicts({"cuda": False, "npu": False}, frozenset())
    finally:
        environment.source_of.cache_clear()
    present = {t.module for p in PATCHES for t in p.targets if environment.module_path(t.module) is not None}
    assert len(texts) >= len(present)
    assert len(texts) == len(set(texts))


def _later_family_targets() -> list[tuple[Patch, object, Family, Family]]:
    """(patch, target, family, its sibling in the first line) for each target of a family later releases brought."""
    found = []
    for family in FAMILIES:
        sibling = next(f for f in FAMILIES if f.line == QWEN3_VL.line and f.moe == family.moe)
        if family.transformers == sibling.transformers and family.verl == sibling.verl:
            continue
        modules = {family.modeling: sibling.modeling, family.verl_forward: sibling.verl_forward}
        found += [(p, t, family, modules[t.module]) for p in PATCHES for t in p.targets if t.module in modules]
    return list({(p.name, t.label): (p, t, f, m) for p, t, f, m in found}.values())  # a line's forward: once


LATER_FAMILY_TARGETS = _later_family_targets()


@pytest.mark.parametrize(
    "patch, target, family, sibling_module",
    LATER_FAMILY_TARGETS,
    ids=[f"{p.name}-{t.label}" for p, t, *_ in LATER_FAMILY_TARGETS],
)
def test_a_stack_without_a_later_family_reads_not_used_for_its_targets(patch: Patch, target, family, sibling_module):
    """transformers < 5.2 and verl < 0.8 have no Qwen3.5: its targets are "not used" there, naming the family; the
    same patch's Qwen3-VL sibling, where it has one, judges its own absence (fails closed unless it declares why it
    may be absent)."""
    from tests.helpers import decide_text
    from verl_qwen3vl_plugin.registry import Verdict

    decision = decide_text(patch, target, None)
    assert decision.verdict is Verdict.NOT_USED and family.line in decision.reason, decision
    sibling = next((t for t in patch.targets if t.module == sibling_module), None)
    if sibling is None:  # a patch of the later family only
        return
    decision = decide_text(patch, sibling, None)
    assert family.line not in decision.reason
    assert decision.verdict is (Verdict.UNRECOGNIZED if sibling.absent is None else Verdict.NOT_USED), decision


def test_generated_files_are_up_to_date():
    """The target index, the docs' per-patch blocks, the compatibility matrix and README's table: from the specs."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "generate.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("patch", PATCHES, ids=NAMES)
def test_probes_read_only_the_modules_their_targets_declare(monkeypatch, patch: Patch):
    real, read = environment.source_of, set()

    def source_of(name: str) -> environment.Source:
        read.add(name)
        return real(name)

    monkeypatch.setattr(environment, "source_of", source_of)
    for target in patch.targets:
        read.clear()
        source = real(target.module)
        if source.tree is not None:
            target.probe(source.tree)
        elif target.absent is not None:
            target.absent()
        assert read <= {target.module, *target.reads}, f"{target.label} reads {sorted(read - {target.module})}"


@pytest.mark.parametrize("name", NAMES)
def test_probes_return_only_declared_shapes(name: str):
    """A probe's verdict comes from a ``Shape`` (``SHAPE.decision(reason)``) or is ``unrecognized``: no spec builds a
    ``Decision`` of its own, so every id and verdict is written once, in a shape."""
    tree = ast.parse(Path(importlib.import_module(f"{patches.__name__}.{name}.spec").__file__).read_text())
    built = [
        node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call) and ast.unparse(node.func) == "Decision"
    ]
    assert not built, f"patches/{name}/spec.py builds a Decision on lines {built}"


@pytest.mark.parametrize("patch", PATCHES, ids=NAMES)
def test_a_shape_id_names_one_verdict(patch: Patch):
    """Appliers and tests branch on shape ids: across a patch's targets, one id never comes with two verdicts."""
    verdicts: dict[str, set[Verdict]] = {}
    for target in patch.targets:
        assert target.shapes, f"{target.label} declares no shapes"
        for shape in target.shapes:
            verdicts.setdefault(shape.id, set()).add(shape.verdict)
    assert not {shape: v for shape, v in verdicts.items() if len(v) > 1}
