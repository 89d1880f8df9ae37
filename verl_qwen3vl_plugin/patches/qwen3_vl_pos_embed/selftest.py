"""Checks of the ``qwen3_vl_pos_embed`` patch: the plugin's interpolation against the upstream ones installed here,
on a Qwen3-VL tower and, where transformers has Qwen3.5, on a Qwen3.5 tower against Qwen3.5's own."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from verl_qwen3vl_plugin.families import QWEN3_5, QWEN3_VL
from verl_qwen3vl_plugin.selftest import Check

GRIDS = [[1, 2, 2], [1, 38, 50], [3, 8, 8], [1, 2, 64], [16, 32, 32]]
# The plugin and upstream sum each table row's contributions in different orders: fp32 rounding then scales with the
# size of the contributions (about the largest gradient), not with a row's possibly cancelled total.
GRAD_RTOL = 1e-6


# The dense member of each model line: the MoE members share its tower (verl >= 0.8 has a device-safe copy in the
# line's forward module)
UPSTREAM = {family.model_type: family for family in (QWEN3_VL, QWEN3_5)}


def references(family: str = "qwen3_vl") -> dict[str, Callable]:
    """The family's upstream interpolations installed here: transformers' own method where its vision forward calls
    it, and verl's copy."""
    from verl_qwen3vl_plugin import originals
    from verl_qwen3vl_plugin.environment import tree
    from verl_qwen3vl_plugin.patches.qwen3_vl_pos_embed.spec import METHOD, probe_vision_class
    from verl_qwen3vl_plugin.registry import Verdict

    line = UPSTREAM[family]
    found = {}
    if probe_vision_class(line, tree(line.modeling)).verdict is Verdict.APPLY:
        tower = getattr(importlib.import_module(line.modeling), line.vision_class)
        found["transformers"] = originals.original(tower, METHOD)
    try:
        found["verl"] = importlib.import_module(line.verl_forward).fast_pos_embed_interpolate
    except (ImportError, AttributeError):  # verl < 0.8: no device-safe copy, and no Qwen3.5
        pass
    return found


def forward_check(
    impl: Callable,
    reference: Callable,
    name: str,
    grid: list,
    dtype: torch.dtype,
    hidden: int = 32,
    family: str = "qwen3_vl",
) -> Check:
    """Outputs must be bit-identical."""
    from verl_qwen3vl_plugin.selftest.tiny_models import vision_tower

    tower = vision_tower(hidden=hidden, dtype=dtype, family=family)
    grid_thw = torch.tensor(grid)
    out, expected = impl(tower, grid_thw), reference(tower, grid_thw)
    same = out.shape == expected.shape and torch.equal(out, expected)
    return Check(f"pos_embed {dtype} vs {name}", same, "bit-identical" if same else "outputs differ")


def gradient_check(
    impl: Callable, reference: Callable, name: str, grid: list, hidden: int = 32, family: str = "qwen3_vl"
) -> Check:
    """The table's fp32 gradient within GRAD_RTOL of the largest gradient entry."""
    from verl_qwen3vl_plugin.selftest.tiny_models import vision_tower

    grid_thw = torch.tensor(grid)
    grad_out = torch.randn(int(grid_thw.prod(-1).sum()), hidden, generator=torch.Generator().manual_seed(1))
    grads = []
    for fn in (impl, reference):
        tower = vision_tower(hidden=hidden, family=family)
        fn(tower, grid_thw).backward(grad_out)
        grads.append(tower.pos_embed.weight.grad)
    diff = float((grads[0] - grads[1]).abs().max() / grads[1].abs().max())
    return Check(f"pos_embed fp32 gradient vs {name}", diff <= GRAD_RTOL, f"max relative difference {diff:.1e}")


def run() -> list[Check]:
    from verl_qwen3vl_plugin.patches.qwen3_vl_pos_embed.replacement import fast_pos_embed_interpolate
    from verl_qwen3vl_plugin.selftest.tiny_models import vision_tower

    checks = []
    for family in UPSTREAM:
        for name, reference in references(family).items():
            label = name if family == "qwen3_vl" else f"{name} {family}"
            for dtype in (torch.float32, torch.bfloat16):
                checks.append(forward_check(fast_pos_embed_interpolate, reference, label, GRIDS, dtype, family=family))
            checks.append(gradient_check(fast_pos_embed_interpolate, reference, label, GRIDS, family=family))
    try:
        fast_pos_embed_interpolate(vision_tower(), torch.tensor([[1, 3, 4]]))
        checks.append(Check("pos_embed rejects an odd grid", False, "no error raised"))
    except ValueError as exc:
        checks.append(Check("pos_embed rejects an odd grid", True, str(exc)))
    return checks
