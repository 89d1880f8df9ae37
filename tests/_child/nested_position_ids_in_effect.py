"""A user's process: ``import verl``, then verl's engine modules; prints which ``maybe_fix_3d_position_ids`` each
one calls, and what it makes of an equal-length batch packed as TransferQueue packs it."""

import json

import verl  # noqa: F401
from verl.utils import tensordict_utils
from verl.workers import engine_workers
from verl.workers.engine import base

import verl_qwen3vl_plugin as plugin
from verl_qwen3vl_plugin.selftest.qwen3_vl_nested_position_ids import engine_rows

callers = {"tensordict_utils": tensordict_utils, "engine_workers": engine_workers, "engine.base": base}
rows, error = engine_rows(engine_workers.maybe_fix_3d_position_ids, [5, 5, 5])
result = {
    "plugins": {name: hasattr(m.maybe_fix_3d_position_ids, "__wrapped__") for name, m in callers.items()},
    "rows": list(rows.shape) if rows is not None else error,
    "status": [s.status.value for s in plugin.patch_statuses() if s.patch == "qwen3_vl_nested_position_ids"],
}
print(json.dumps(result))
