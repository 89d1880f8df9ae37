"""The trainer's experts against the rollout's record, measured in the trainer workers of the end-to-end run (named in
``VERL_USE_EXTERNAL_MODULES`` after ``verl_side``). Test-only, and the same code in both modes, so R3 and no replay
are measured alike; it reads the routes each router returned, after the plugin's replay where that is on.

For every update micro-batch (``forward_backward_batch(forward_only=False)``) whose batch carries the rollout's
``routed_experts``, each MoE router's top-k ids for each token are compared, as sets, with the record's row for that
token; rows without a route (verl writes zeros for padding and the last token: all ids equal) are not counted. One
JSON line per update call goes to ``$E2E_ROUTES_FILE``.
"""

from __future__ import annotations

import functools
import json
import os
import sys

KEY = "routed_experts"
_state = {"training": False, "record": None, "pairs": 0, "mismatched": 0}


def _router_hook(module, inputs, output) -> None:
    record = _state["record"]
    if record is None or not _state["training"]:
        return
    ids = output[-1].reshape(-1, output[-1].shape[-1])
    if record.shape[0] > ids.shape[0]:
        raise ValueError(f"the route record has {record.shape[0]} rows for {ids.shape[0]} routed tokens")
    tokens = record.shape[0]  # static padding past the last sample has no record
    ids, rows = ids[:tokens], record[:, module.e2e_layer].long()
    recorded = rows.min(-1).values != rows.max(-1).values
    if not recorded.any():
        return
    same = (ids[recorded].sort(-1).values == rows[recorded].sort(-1).values).all(-1)
    _state["pairs"] += int(recorded.sum())
    _state["mismatched"] += int((~same).sum())


def _instrument(module) -> None:
    engine, lm_head = module.FSDPEngine, module.FSDPEngineWithLMHead
    forward_backward = engine.forward_backward_batch
    prepare = lm_head.prepare_model_inputs

    @functools.wraps(forward_backward)
    def forward_backward_batch(self, data, loss_function, forward_only=False):
        if not getattr(self, "e2e_hooked", False):
            routers = [m for m in self.module.modules() if type(m).__name__.endswith("TopKRouter")]
            for layer, router in enumerate(routers):
                router.e2e_layer = layer
                router.register_forward_hook(_router_hook)
            self.e2e_hooked = True
        _state.update(training=not forward_only, pairs=0, mismatched=0)
        try:
            return forward_backward(self, data, loss_function, forward_only)
        finally:
            if not forward_only and _state["pairs"] and os.environ.get("E2E_ROUTES_FILE"):
                line = {"pid": os.getpid(), "pairs": _state["pairs"], "mismatched": _state["mismatched"]}
                with open(os.environ["E2E_ROUTES_FILE"], "a") as out:
                    out.write(json.dumps(line) + "\n")
            _state.update(training=False, record=None)

    @functools.wraps(prepare)
    def prepare_model_inputs(self, micro_batch):
        record = micro_batch.get(KEY, None)
        _state["record"] = record.values() if record is not None and record.is_nested else None
        return prepare(self, micro_batch)

    engine.forward_backward_batch = forward_backward_batch
    lm_head.prepare_model_inputs = prepare_model_inputs


def _install() -> None:
    from e2e_cpu_shims.verl_side import _after_import

    _after_import("verl.workers.engine.fsdp.transformer_impl", lambda: _instrument(sys.modules[
        "verl.workers.engine.fsdp.transformer_impl"]))  # fmt: skip


if os.environ.get("E2E_ROUTES_FILE"):
    _install()
