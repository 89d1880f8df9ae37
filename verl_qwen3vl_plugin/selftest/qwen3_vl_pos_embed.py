"""Checks of the ``qwen3_vl_pos_embed`` patch: the plugin's interpolation against the upstream ones installed here."""

from __future__ import annotations

from collections.abc import Callable

import torch

from verl_qwen3vl_plugin.selftest import Check

GRIDS = [[1, 2, 2], [1, 38, 50], [3, 8, 8], [1, 2, 64], [16, 32, 32]]
# The plugin and upstream sum each table row's contributions in different orders: fp32 rounding then scales with the
# size of the contributions (about the largest gradient), not with a row's possibly cancelled total.
GRAD_RTOL = 1e-6


def references() -> dict[str, Callable]:
    """Upstream interpolations installed here: transformers' own (where its forward calls it) and verl's fix."""
    from transformers.models.qwen3_vl import modeling_qwen3_vl

    from verl_qwen3vl_plugin.compat import tree
    from verl_qwen3vl_plugin.patches.qwen3_vl_pos_embed import decide_vision_class, upstream_method
    from verl_qwen3vl_plugin.registry import Verdict

    references = {}
    if decide_vision_class("Qwen3VLVisionModel", tree(modeling_qwen3_vl.__name__)).verdict is Verdict.APPLY:
        references["transformers"] = upstream_method(modeling_qwen3_vl.Qwen3VLVisionModel)
    try:
        from verl.models.transformers.qwen3_vl import fast_pos_embed_interpolate as verl_version
    except ImportError:  # verl < 0.8 has no fixed copy
        pass
    else:
        references["verl"] = verl_version
    return references


def forward_check(
    impl: Callable, reference: Callable, name: str, grid: list, dtype: torch.dtype, hidden: int = 32
) -> Check:
    """Outputs must be bit-identical."""
    from verl_qwen3vl_plugin.selftest.tiny_models import vision_tower

    tower = vision_tower(hidden=hidden, dtype=dtype)
    grid_thw = torch.tensor(grid)
    out, expected = impl(tower, grid_thw), reference(tower, grid_thw)
    same = out.shape == expected.shape and torch.equal(out, expected)
    return Check(f"pos_embed {dtype} vs {name}", same, "bit-identical" if same else "outputs differ")


def gradient_check(impl: Callable, reference: Callable, name: str, grid: list, hidden: int = 32) -> Check:
    """The table's fp32 gradient within GRAD_RTOL of the largest gradient entry."""
    from verl_qwen3vl_plugin.selftest.tiny_models import vision_tower

    grid_thw = torch.tensor(grid)
    grad_out = torch.randn(int(grid_thw.prod(-1).sum()), hidden, generator=torch.Generator().manual_seed(1))
    grads = []
    for fn in (impl, reference):
        tower = vision_tower(hidden=hidden)
        fn(tower, grid_thw).backward(grad_out)
        grads.append(tower.pos_embed.weight.grad)
    diff = float((grads[0] - grads[1]).abs().max() / grads[1].abs().max())
    return Check(f"pos_embed fp32 gradient vs {name}", diff <= GRAD_RTOL, f"max relative difference {diff:.1e}")


def run() -> list[Check]:
    from verl_qwen3vl_plugin.replacements.qwen3_vl_pos_embed import fast_pos_embed_interpolate
    from verl_qwen3vl_plugin.selftest.tiny_models import vision_tower

    checks = []
    for name, reference in references().items():
        for dtype in (torch.float32, torch.bfloat16):
            checks.append(forward_check(fast_pos_embed_interpolate, reference, name, GRIDS, dtype))
        checks.append(gradient_check(fast_pos_embed_interpolate, reference, name, GRIDS))
    try:
        fast_pos_embed_interpolate(vision_tower(), torch.tensor([[1, 3, 4]]))
        checks.append(Check("pos_embed rejects an odd grid", False, "no error raised"))
    except ValueError as exc:
        checks.append(Check("pos_embed rejects an odd grid", True, str(exc)))
    return checks
