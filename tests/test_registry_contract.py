"""The registry, the patch modules, the entry points and the docs agree: adding a patch means one module, one line in
``patches.PATCHES`` and one docs section, and this fails until all three are there."""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import re
from importlib import metadata

import pytest

from tests.helpers import ROOT
from verl_qwen3vl_plugin import patches
from verl_qwen3vl_plugin.patches import NAMES, PATCHES
from verl_qwen3vl_plugin.registry import HOOK_MODULES, Patch

PATCHES_DOC = (ROOT / "docs" / "patches.md").read_text()
COMPATIBILITY_DOC = (ROOT / "docs" / "compatibility.md").read_text()


def test_every_patch_module_is_listed():
    modules = [m.name for m in pkgutil.iter_modules(patches.__path__)]
    assert modules, "no patch modules found"
    for name in modules:
        module = importlib.import_module(f"{patches.__name__}.{name}")
        assert isinstance(getattr(module, "PATCH", None), Patch), f"{name} defines no PATCH spec"
        assert module.PATCH in PATCHES, f"patches/{name}.py is not listed in patches.PATCHES"


def test_names_unique():
    assert len(set(NAMES)) == len(NAMES)


@pytest.mark.parametrize("patch", PATCHES, ids=NAMES)
def test_spec_is_complete(patch: Patch):
    assert patch.group in HOOK_MODULES, patch.group
    for field in ("why", "how", "remove_when"):
        assert getattr(patch, field).strip(), f"{patch.name}: empty {field}"
    assert patch.upstream and all(re.fullmatch(r"(verl|transformers|vllm-ascend)#\d+", r) for r in patch.upstream)
    assert patch.targets and len({t.module for t in patch.targets}) == len(patch.targets)
    assert importlib.util.find_spec(patch.selftest) is not None, patch.selftest
    assert patch.devices is None or set(patch.devices) <= {"cuda", "npu"}


@pytest.mark.parametrize("patch", PATCHES, ids=NAMES)
def test_docs_have_a_section_per_patch(patch: Patch):
    section = re.search(rf"^## `{patch.name}`.*?(?=^## |\Z)", PATCHES_DOC, re.S | re.M)
    assert section, f"docs/patches.md has no section for {patch.name}"
    for heading in ("**Why.**", "**How.**", "**Upstream.**", "**Remove when.**"):
        assert heading in section.group(0), f"{patch.name}: no {heading}"
    assert f"**Remove when.** {patch.remove_when}" in " ".join(section.group(0).split()), f"{patch.name}: remove-when"
    for reference in patch.upstream:
        assert reference.split("#")[1] in section.group(0), f"{patch.name}: {reference} not in its docs section"
    assert f"`{patch.name}`" in COMPATIBILITY_DOC, f"docs/compatibility.md has no column for {patch.name}"


def test_docs_have_no_section_for_an_unknown_patch():
    assert set(re.findall(r"^## `([a-z0-9_]+)`", PATCHES_DOC, re.M)) == set(NAMES)


def test_entry_points_name_the_hook_modules():
    """The installed metadata, which pip builds from pyproject.toml: one entry point per hook group."""
    ours = [ep for ep in metadata.entry_points(group="verl.plugins") if ep.value.startswith("verl_qwen3vl_plugin.")]
    assert sorted(ep.value for ep in ours) == sorted(HOOK_MODULES.values())
