"""The interpolation inside a real FSDP2-sharded vision tower: 2 ranks on the CPU (gloo), ``pos_embed`` sharded on
its own as verl's FSDP2 wrapping does. The table must be gathered through the module, not read as a shard.

(The CPU-offload device mismatch itself needs an accelerator: ``benchmarks/gpu_check.py``.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import child_json

HERE = Path(__file__).parent  # this patch's child scripts

pytest.importorskip("torch.distributed.fsdp", reason="needs torch's FSDP2")


def test_sharded_table_gathered_through_the_module():
    results = child_json(HERE / "fsdp2_case.py")
    assert [r["sharded"] for r in results] == ["DTensor", "DTensor"]
    assert all(r["equal"] for r in results), results
    assert all(r["grad_close"] for r in results), results
