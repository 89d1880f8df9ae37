"""Every path of this repository that README.md and docs/ name exists: a rename that leaves a doc behind fails here.

Upstream paths the docs also name (verl's ``verl/...``, its ``tests/models/...``) are not this repository's and are
not checked; package-relative paths (``selftest/...``) are resolved under ``verl_qwen3vl_plugin/``.
"""

from __future__ import annotations

import re

import pytest

from tests.helpers import ROOT

DOCS = [
    ROOT / "README.md",
    ROOT / "CONTRIBUTING.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "recipes").rglob("*.md")),
]
OURS = ("verl_qwen3vl_plugin/", "benchmarks/", "recipes/", "docs/", "startup/", ".ci/", "noxfile.py",
        "pyproject.toml", "CHANGELOG.md", "README.md", "CONTRIBUTING.md", "scripts/", "tests/_child/",
        "tests/patches/", "tests/e2e/", "tests/recipes/", "tests/test_", "tests/helpers.py",
        "tests/conftest.py")  # fmt: skip
PACKAGE_RELATIVE = ("selftest/", "patches/", "hooks/", "models/")
PATH = re.compile(r"`([\w./-]+?)(?:::[\w.]+)?`")


def named_paths(text: str) -> set[str]:
    found = set()
    for token in PATH.findall(text):
        if token.startswith(OURS):
            found.add(token)
        elif token.startswith(PACKAGE_RELATIVE):
            found.add(f"verl_qwen3vl_plugin/{token}")
    return found


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_repository_path_named_exists(doc):
    missing = sorted(p for p in named_paths(doc.read_text()) if not (ROOT / p).exists())
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_the_check_sees_paths():
    """The control: the pattern finds a package-relative and a rooted path, and skips upstream ones."""
    text = "`selftest/ranks.py`, `benchmarks/pos_embed.py::main`, `verl/workers/engine/fsdp/utils.py`"
    assert named_paths(text) == {"verl_qwen3vl_plugin/selftest/ranks.py", "benchmarks/pos_embed.py"}


def test_every_table_of_figures_names_the_command_that_printed_it():
    """A section of docs/performance.md that quotes measured figures (a table) names its benchmark or nox session,
    so that the figures can be re-measured when that code changes."""
    sections = re.split(r"^## ", (ROOT / "docs" / "performance.md").read_text(), flags=re.M)[1:]
    unnamed = [
        s.splitlines()[0]
        for s in sections
        if "|---" in s and not re.search(r"`(?:python )?benchmarks/\w+\.py|nox -s \w+", s)
    ]
    assert not unnamed, f"sections with figures but no command: {unnamed}"
