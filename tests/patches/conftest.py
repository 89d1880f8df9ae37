"""The ``npu`` fixture of the NPU patches' tests (``tests/npu_fixture.py``), here so that its folders share it.

Session scope: verl's npu_patch rewires transformers for the rest of the process, so the references can be taken
only once, before it (a second set-up would take verl's NPU block for transformers' own). Every test that uses it is
marked ``fake_npu`` and runs in a pytest process of its own (see noxfile.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from tests.npu_fixture import npu_stack


@pytest.fixture(scope="session")
def npu() -> Iterator[SimpleNamespace]:
    yield from npu_stack()
