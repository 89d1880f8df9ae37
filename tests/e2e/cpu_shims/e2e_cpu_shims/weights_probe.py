"""The rollout's weights against the trainer's after each parameter sync, for the end-to-end run only (named in
``VERL_USE_EXTERNAL_MODULES``; it acts where ``$E2E_WEIGHTS_FILE`` is set).

The trainer side is the checkpoint engine's source (``checkpoint_engine``): the tensors it sends, in the rollout's
dtype. The rollout side is vLLM's own parameters, read in vLLM's worker process right after verl's worker extension
has loaded a sync and post-processed it (``update_weights_from_ipc``). vLLM stacks and renames the trainer's tensors
(q, k and v into one ``qkv_proj``, the experts into ``w13`` / ``w2``, padded vocabulary rows), so names do not map one
to one; sums do: each side sums every parameter (x and x squared, in float64) per tower and decoder or vision layer,
and those sums survive stacking, transposes and zero padding. A stale, partial or garbled sync changes them.

One JSON line per sync and side goes to ``$E2E_WEIGHTS_FILE``; the run pairs the n-th sync of both sides.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys

import torch

LAYER = re.compile(r"\.(?:layers|blocks)\.(\d+)\.")


def group(name: str) -> str:
    """The tower and layer a parameter belongs to, in a form both HF's and vLLM's names give alike."""
    tower = "visual" if re.search(r"(^|\.)visual\.", name) else "language"
    layer = LAYER.search(name)
    return f"{tower}.{layer.group(1) if layer else 'other'}"


class Sums:
    def __init__(self) -> None:
        self.groups: dict[str, list[float]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        values = tensor.detach().double()
        total = self.groups.setdefault(group(name), [0.0, 0.0, 0])
        total[0] += float(values.sum())
        total[1] += float(values.square().sum())
        total[2] += values.numel()


def write(side: str, sums: Sums, version: int | None = None) -> None:
    path = os.environ.get("E2E_WEIGHTS_FILE")
    if not path:
        return
    line = {"side": side, "pid": os.getpid(), "version": version, "groups": sums.groups}
    with open(path, "a") as out:
        out.write(json.dumps(line) + "\n")


def max_difference(trainer: dict[str, list[float]], rollout: dict[str, list[float]]) -> float:
    """The largest relative difference of a group's sums (the sum of x against the root of n times the sum of x
    squared, which bounds the sum of |x|); infinity where a group is on one side only. Counts may differ (vLLM pads
    the vocabulary with zero rows)."""
    if trainer.keys() != rollout.keys():
        return float("inf")
    worst = 0.0
    for key, (s1, s2, n) in trainer.items():
        r1, r2, _ = rollout[key]
        scale = max(s2, 1e-30)
        worst = max(worst, abs(r1 - s1) / (n * scale) ** 0.5, abs(r2 - s2) / scale)
    return worst


def _instrument(module) -> None:
    extension = module.vLLMColocateWorkerExtension
    update = extension.update_weights_from_ipc

    @functools.wraps(update)
    def update_weights_from_ipc(self, *args, **kwargs):
        result = update(self, *args, **kwargs)
        sums = Sums()
        for name, parameter in self.model_runner.model.named_parameters():
            sums.add(name, parameter)
        write("rollout", sums)
        return result

    extension.update_weights_from_ipc = update_weights_from_ipc


if os.environ.get("E2E_WEIGHTS_FILE"):
    from e2e_cpu_shims.verl_side import _after_import

    name = "verl.workers.rollout.vllm_rollout.utils"
    _after_import(name, lambda: _instrument(sys.modules[name]))
