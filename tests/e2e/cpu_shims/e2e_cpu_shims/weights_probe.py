"""The rollout's weights against the trainer's after each parameter sync, for the end-to-end run only (named in
``VERL_USE_EXTERNAL_MODULES``; it acts where ``$E2E_WEIGHTS_FILE`` is set).

The trainer side is the checkpoint engine's source (``checkpoint_engine``): the tensors it sends, in the rollout's
dtype. The rollout side is vLLM's own parameters, read in vLLM's worker process right after verl's worker extension
has loaded a sync and post-processed it (``update_weights_from_ipc``). vLLM stacks and renames the trainer's tensors
(q, k and v into one ``qkv_proj``, the experts into ``w13`` / ``w2``, padded vocabulary rows), so names do not map one
to one; sums do. Each side sums every parameter per tower and decoder or vision layer (in float64): x and x squared,
which survive stacking, transposes and zero padding, and x weighted by its position, which a permutation changes.
The position is what both sides agree on: the column (the flat index past the first dim, which row stacking keeps),
and for experts, in vLLM's ``w13`` (E, 2I, H) / ``w2`` (E, H, I) coordinates, the expert and the row too (gate rows
then up rows). x and x squared alone cannot see scrambled experts: a transpose of a square expert, or two experts
swapped, keep them. A stale, partial, garbled or scrambled sync changes the weighted sums.

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
# An expert tensor's name: the trainer's per-expert keys, transformers 5's packed ones, or vLLM's (0.27 puts them
# under ``routed_experts``).
EXPERT = re.compile(
    r"\.mlp\.experts\.(?:routed_experts\.)?(?:(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight"
    r"|(?P<packed>gate_up_proj|down_proj|w13_weight|w2_weight))$"
)


def group(name: str) -> str:
    """The tower and layer a parameter belongs to, in a form both HF's and vLLM's names give alike."""
    tower = "visual" if re.search(r"(^|\.)visual\.", name) else "language"
    layer = LAYER.search(name)
    return f"{tower}.{layer.group(1) if layer else 'other'}"


def positions(name: str, values: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``values`` seen as (experts, rows, columns), and each element's expert, row and column, broadcastable to it:
    experts in vLLM's ``w13`` / ``w2`` coordinates (a per-expert ``up_proj`` sits below its ``gate_proj``), every
    other tensor as one expert whose rows all count as row 0 (stacking moves rows), its columns flattened past the
    first dim."""
    found = EXPERT.search(name)
    if found and found["packed"]:
        e, r, c = values.shape
        index = torch.arange(e).view(-1, 1, 1), torch.arange(r).view(1, -1, 1), torch.arange(c).view(1, 1, -1)
        return values, index
    if found:
        rows, columns = values.shape
        offset = rows if found["proj"] == "up_proj" else 0
        expert = torch.tensor(int(found["expert"])).view(1, 1, 1)
        index = expert, (torch.arange(rows) + offset).view(1, -1, 1), torch.arange(columns).view(1, 1, -1)
        return values.unsqueeze(0), index
    columns = values[0].numel() if values.dim() > 1 else 1
    zero = torch.zeros(1, 1, 1, dtype=torch.long)
    return values.reshape(1, -1, columns), (zero, zero, torch.arange(columns).view(1, 1, -1))


class Sums:
    def __init__(self) -> None:
        self.groups: dict[str, list[float]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        values = tensor.detach().double()
        shaped, index = positions(name, values)
        total = self.groups.setdefault(group(name), [0.0] * 9)
        total[0] += float(values.sum())
        total[1] += float(values.square().sum())
        total[2] += values.numel()
        for i, position in enumerate(index):
            weight = (1 + position).double()
            total[3 + i] += float((shaped * weight).sum())
            total[6 + i] += float((shaped.abs() * weight).sum())


def write(side: str, sums: Sums, version: int | None = None) -> None:
    path = os.environ.get("E2E_WEIGHTS_FILE")
    if not path:
        return
    line = {"side": side, "pid": os.getpid(), "version": version, "groups": sums.groups}
    with open(path, "a") as out:
        out.write(json.dumps(line) + "\n")


def max_difference(trainer: dict[str, list[float]], rollout: dict[str, list[float]], weighted: bool = True) -> float:
    """The largest relative difference of a group's sums: the sum of x against the root of n times the sum of x
    squared (which bounds the sum of |x|), each sum weighted by position against the same weighted sum of |x|
    (``weighted``: False gives the check before positions were weighed, which scrambled experts pass); infinity where
    a group is on one side only. Counts may differ (vLLM pads the vocabulary with zero rows)."""
    if trainer.keys() != rollout.keys():
        return float("inf")
    worst = 0.0
    for key, sums in trainer.items():
        (s1, s2, n, *positional), (r1, r2, _, *theirs) = sums, rollout[key]
        scale = max(s2, 1e-30)
        worst = max(worst, abs(r1 - s1) / (n * scale) ** 0.5, abs(r2 - s2) / scale)
        for ours, other, bound in zip(positional[:3], theirs[:3], positional[3:], strict=True) if weighted else ():
            worst = max(worst, abs(other - ours) / max(bound, 1e-30))
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
