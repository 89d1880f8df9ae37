"""A user's process: ``import verl``, then verl's engine modules; prints which ``maybe_fix_3d_position_ids`` each
one calls, and what it makes of an equal-length batch packed as TransferQueue packs it. (verl 0.8.0's engine worker
imports uvicorn, which verl does not declare: a module that cannot import here is left out.)"""

import importlib
import json

import verl  # noqa: F401

import verl_qwen3vl_plugin as plugin
from verl_qwen3vl_plugin.patches.qwen3_vl_nested_position_ids import CALLERS, FUNCTION
from verl_qwen3vl_plugin.replacements.qwen3_vl_nested_position_ids import maybe_fix_3d_position_ids
from verl_qwen3vl_plugin.selftest.qwen3_vl_nested_position_ids import engine_rows

callers = {}
for name in CALLERS:
    try:
        callers[name] = importlib.import_module(name)
    except ImportError:
        pass
fix = getattr(callers["verl.workers.engine.base"], FUNCTION)
rows, error = engine_rows(fix, [5, 5, 5])
result = {
    "plugins": {name: getattr(m, FUNCTION) is maybe_fix_3d_position_ids for name, m in callers.items()},
    "rows": list(rows.shape) if rows is not None else error,
    "applied": sum(
        s.status.value == "applied" for s in plugin.patch_statuses() if s.patch == "qwen3_vl_nested_position_ids"
    ),
}
print(json.dumps(result))
