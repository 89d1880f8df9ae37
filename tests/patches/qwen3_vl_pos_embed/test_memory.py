"""Long thin grids: the interpolation's caches grow with the distinct grid sizes seen, not with the square of the
largest side (a fresh process, ``pos_embed_first_call.py``, beside this file). What a first call on a new size costs is
measured in ``benchmarks/pos_embed_first_call.py``, not asserted here."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers import child_json
from verl_qwen3vl_plugin.patches.qwen3_vl_pos_embed import replacement as qwen3_vl
from verl_qwen3vl_plugin.patches.qwen3_vl_pos_embed.replacement import fast_pos_embed_interpolate
from verl_qwen3vl_plugin.selftest.tiny_models import vision_tower

HERE = Path(__file__).parent  # this patch's child scripts

KEPT_LIMIT = 64 * 2**20


def test_memory_kept_after_long_thin_grids():
    kept = child_json(HERE / "pos_embed_first_call.py", "plugin", "1024", "8192")["kept_bytes"]
    assert kept <= KEPT_LIMIT, f"{kept / 2**20:.0f} MiB kept after [1, 2, 1024] and [1, 2, 8192]"


def test_cache_is_bounded_and_least_recently_used_goes_first(monkeypatch):
    monkeypatch.setattr(qwen3_vl, "_GRID_CACHE", type(qwen3_vl._GRID_CACHE)())
    monkeypatch.setattr(qwen3_vl, "_grid_cache_values", 0)
    monkeypatch.setattr(qwen3_vl, "_GRID_CACHE_MAX_VALUES", 100)
    tower = vision_tower(hidden=16)
    for width in range(2, 120, 2):  # many distinct sizes: more than the bound holds
        fast_pos_embed_interpolate(tower, torch.tensor([[1, 2, width]]))
        assert qwen3_vl._grid_cache_values <= 100 + width
    cached = [n for (_, _, n) in qwen3_vl._GRID_CACHE]
    assert 118 in cached and 4 not in cached and sum(cached) == qwen3_vl._grid_cache_values
