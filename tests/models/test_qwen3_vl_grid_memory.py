"""Long thin grids: the interpolation's caches grow with the distinct grid sizes seen, not with the square of the
largest side, and a first call on a new size costs about what upstream's call costs. Each figure comes from a fresh
process (``tests/_child/pos_embed_first_call.py``); times are medians of alternating runs against upstream."""

from __future__ import annotations

import statistics

import pytest
import torch

from tests.helpers import child_json
from verl_qwen3vl_plugin.models import qwen3_vl
from verl_qwen3vl_plugin.models.qwen3_vl import fast_pos_embed_interpolate
from verl_qwen3vl_plugin.selftest.pos_embed import references
from verl_qwen3vl_plugin.selftest.tiny_models import vision_tower

REFERENCE = next(iter(references()), None)
KEPT_LIMIT = 64 * 2**20
WIDTHS = ("1024", "8192")
RUNS = 3


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    """Fresh processes, alternating: the plugin and (where this stack has one) upstream."""
    impls = ["plugin"] + ([REFERENCE] if REFERENCE else [])
    results = {impl: [] for impl in impls}
    for _ in range(RUNS):
        for impl in impls:
            results[impl].append(child_json("pos_embed_first_call.py", impl, *WIDTHS))
    return results


def test_memory_kept_after_long_thin_grids(runs):
    kept = max(run["kept_bytes"] for run in runs["plugin"])
    assert kept <= KEPT_LIMIT, f"{kept / 2**20:.0f} MiB kept after [1, 2, 1024] and [1, 2, 8192]"


@pytest.mark.skipif(REFERENCE is None, reason="no upstream interpolation on this stack")
@pytest.mark.parametrize("width", WIDTHS)
def test_first_call_within_twice_upstream(runs, width):
    plugin = statistics.median(run["seconds"][width] for run in runs["plugin"])
    upstream = statistics.median(run["seconds"][width] for run in runs[REFERENCE])
    assert plugin <= 2 * upstream, f"plugin {plugin * 1e3:.0f} ms, {REFERENCE} {upstream * 1e3:.0f} ms"


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
