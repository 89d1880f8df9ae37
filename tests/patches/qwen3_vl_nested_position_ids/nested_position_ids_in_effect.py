"""A user's process: ``import verl``, then verl's engine modules; prints which ``maybe_fix_3d_position_ids`` each
one calls, what it makes of an equal-length batch packed as TransferQueue packs it, and what the FSDP engine reads of
that batch's micro-batches after its own split. (verl 0.8.0's engine worker imports uvicorn, which verl does not
declare: a module that cannot import here is left out.)"""

import importlib
import json

import verl  # noqa: F401

import verl_qwen3vl_plugin as plugin
from verl_qwen3vl_plugin.patches.qwen3_vl_nested_position_ids.replacement import maybe_fix_3d_position_ids
from verl_qwen3vl_plugin.patches.qwen3_vl_nested_position_ids.selftest import engine_rows, packed_batch
from verl_qwen3vl_plugin.patches.qwen3_vl_nested_position_ids.spec import CALLERS, FUNCTION

callers = {}
for name in CALLERS:
    try:
        callers[name] = importlib.import_module(name)
    except ImportError:
        pass
fix = getattr(callers["verl.workers.engine.base"], FUNCTION)
rows, error = engine_rows(fix, [5, 5, 5])
from verl.utils import tensordict_utils  # noqa: E402
from verl.workers.engine.fsdp import transformer_impl as engine  # noqa: E402

batch = packed_batch([5, 5, 5, 5])
fix(batch)
tensordict_utils.assign_non_tensor(batch, use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
try:
    micro_batches = [list(mb["position_ids"].values().shape) for mb in engine.prepare_micro_batches(batch)[0]]
except RuntimeError as exc:  # verl's own relabelled batch cannot be split
    micro_batches = f"{type(exc).__name__}: {str(exc)[:80]}"
result = {
    "plugins": {name: getattr(m, FUNCTION) is maybe_fix_3d_position_ids for name, m in callers.items()},
    "rows": list(rows.shape) if rows is not None else error,
    "micro_batches": micro_batches,
    "applied": sorted(
        s.target
        for s in plugin.patch_statuses()
        if s.patch == "qwen3_vl_nested_position_ids" and s.status.value == "applied"
    ),
}
print(json.dumps(result))
