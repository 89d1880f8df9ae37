"""Interpolation calls on long thin grids in a fresh process: their times, and the memory they leave resident.

    pos_embed_first_call.py IMPL WIDTH...   (IMPL: plugin, or a reference from the patch's selftest.references())

Prints the seconds of the first call on each grid [1, 2, WIDTH] (hidden 16; distinct widths share no grid size
beyond 2) and the growth of the resident set once the outputs are freed: what caches keep.
"""

import gc
import json
import sys
import time

import torch

from verl_qwen3vl_plugin.patches.qwen3_vl_pos_embed.replacement import fast_pos_embed_interpolate
from verl_qwen3vl_plugin.patches.qwen3_vl_pos_embed.selftest import references
from verl_qwen3vl_plugin.selftest.tiny_models import vision_tower


def resident_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


impl, widths = sys.argv[1], [int(w) for w in sys.argv[2:]]
torch.set_num_threads(1)  # as the benchmarks measure: intra-op threads make times swing on a shared machine
fn = fast_pos_embed_interpolate if impl == "plugin" else references()[impl]
tower = vision_tower(hidden=16)
fn(tower, torch.tensor([[1, 2, 2]]))  # the kernels' first use is not what is measured
gc.collect()
before = resident_bytes()
seconds = {}
for width in widths:
    start = time.perf_counter()
    out = fn(tower, torch.tensor([[1, 2, width]]))
    seconds[width] = time.perf_counter() - start
    del out
gc.collect()
print(json.dumps({"seconds": seconds, "kept_bytes": resident_bytes() - before}))
