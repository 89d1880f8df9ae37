"""The three NPU patches' self-tests share one child process (``selftest/npu_qwen3_vl_moe.py`` says why): each
patch's ``run()`` must take exactly its own checks from it, none may fall between them, and the doctor, which runs
the three, must start the child once."""

from __future__ import annotations

import importlib

import pytest

from verl_qwen3vl_plugin.patches import PATCHES
from verl_qwen3vl_plugin.selftest import Check
from verl_qwen3vl_plugin.selftest import npu_qwen3_vl_moe as shared

NPU_PATCHES = [p for p in PATCHES if p.name in shared.OWNED]


@pytest.fixture
def starts(monkeypatch) -> list[str]:
    """The shared child's starts, each by name; its cache cleared before and after."""
    started = []
    real = shared.in_child

    def counting(module: str, name: str, drop: tuple[str, ...] = ()) -> list[Check]:
        started.append(module)
        return real(module, name, drop)

    monkeypatch.setattr(shared, "in_child", counting)
    shared.child_checks.cache_clear()
    yield started
    shared.child_checks.cache_clear()


def test_each_npu_patch_has_a_self_test_module_of_its_own():
    assert sorted(p.name for p in NPU_PATCHES) == sorted(shared.OWNED)
    assert len({p.selftest for p in NPU_PATCHES}) == len(NPU_PATCHES)
    assert all(p.selftest == f"verl_qwen3vl_plugin.patches.{p.name}.selftest" for p in NPU_PATCHES)


def test_the_patches_split_the_shared_child_s_checks_between_them(starts):
    per_patch = {p.name: importlib.import_module(p.selftest).run() for p in NPU_PATCHES}
    assert starts == [shared.__name__]  # one child for the three
    made = list(shared.child_checks())
    taken = [check for checks in per_patch.values() for check in checks]
    assert sorted(taken) == sorted(made), "a check of the child that no patch, or two, took"
    assert all(c.ok for c in made), made
    for name, checks in per_patch.items():  # its decision first, then only checks it owns: no swap, no borrowing
        first, *rest = [c.name for c in checks]
        assert first == f"{name} decision" and set(rest) <= set(shared.OWNED[name]), (name, checks)


def test_a_child_that_fails_fails_every_npu_patch(starts, monkeypatch):
    monkeypatch.setattr(shared, "in_child", lambda module, name, drop=(): [Check(name, False, "child process failed")])
    for patch in NPU_PATCHES:
        assert importlib.import_module(patch.selftest).run() == [Check(shared.CHILD, False, "child process failed")]
