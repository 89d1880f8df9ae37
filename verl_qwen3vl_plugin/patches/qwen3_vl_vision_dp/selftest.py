"""Checks of the ``qwen3_vl_vision_dp`` patch: a tiny vision tower on two CPU ranks (gloo) in one verl Ulysses
group, the plugin's split forward against upstream's whole forward on every image.

Each rank must see only its share of the patches, the gathered embeddings and deepstack features must match
upstream's, and the parameter gradients averaged over the two ranks (as FSDP reduces them) must match upstream's.
Ranks given different images must both raise the split's clear error. Where transformers has Qwen3.5, a Qwen3.5
tower (no deepstack features, a pooling output) gets two of the cases too.
"""

from __future__ import annotations

import torch

from verl_qwen3vl_plugin import originals
from verl_qwen3vl_plugin.selftest import Check

# Rows of one image pass the tower in a different batch than upstream's: fp32 rounding of the matmuls differs.
# Relative to each tensor's largest entry: an element-wise bound fails on entries near zero (seen: 4e-6 of 23).
RTOL = 1e-5
CASES = {
    "three images": [[1, 4, 6], [1, 8, 8], [1, 2, 2]],
    "one image, two ranks": [[1, 6, 4]],
    "one large among small": [[1, 2, 2], [1, 16, 16], [1, 2, 4], [1, 4, 2]],
    "a video": [[3, 4, 4], [1, 2, 2]],
}


QWEN3_5_CASES = ("three images", "a video")


def _towers(family: str = "qwen3_vl"):
    from verl_qwen3vl_plugin.selftest.tiny_models import VISION, randomize

    if family == "qwen3_5":
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig as Config
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel as Model

        config = {k: v for k, v in VISION.items() if k != "deepstack_visual_indexes"}
    else:
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig as Config
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as Model

        config = VISION

    def tower():
        return randomize(Model(Config(**config)), seed=0)

    return Model, tower


def compare(grid: list[list[int]], family: str = "qwen3_vl") -> dict:
    """On a rank of an initialised 2-rank group: the split forward against upstream's, and patch counts."""
    import torch.distributed as dist
    from verl.utils.ulysses import set_ulysses_sequence_parallel_group

    from verl_qwen3vl_plugin.patches.qwen3_vl_vision_dp.replacement import split_output, vision_dp_forward
    from verl_qwen3vl_plugin.selftest.tiny_models import pixel_values

    cls, tower = _towers(family)
    upstream = originals.original(cls, "forward")
    grid_thw, pixels = torch.tensor(grid), pixel_values(torch.tensor(grid))
    weights = None
    results = {}
    for name, forward in (("upstream", upstream), ("plugin", vision_dp_forward(upstream))):
        model, seen = tower(), []
        model.patch_embed.register_forward_pre_hook(lambda _, args, seen=seen: seen.append(args[0].shape[0]))
        set_ulysses_sequence_parallel_group(dist.group.WORLD if name == "plugin" else None)
        try:
            embeds, deepstack = split_output(forward(model, pixels, grid_thw))
            outs = [embeds, *deepstack]
        finally:
            set_ulysses_sequence_parallel_group(None)
        if weights is None:
            generator = torch.Generator().manual_seed(1)
            weights = [torch.randn(o.shape, generator=generator) for o in outs]
        sum((o * w).sum() for o, w in zip(outs, weights, strict=True)).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        if name == "plugin":
            for g in grads:
                dist.all_reduce(g)
                g /= dist.get_world_size()
        results[name] = (outs, grads, seen)
    (up_outs, up_grads, _), (outs, grads, seen) = results["upstream"], results["plugin"]

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and bool((a - b).abs().max() <= RTOL * b.abs().max())

    return {
        "patches_seen": seen,
        "outputs_close": all(close(a, b) for a, b in zip(outs, up_outs, strict=True)),
        "grads_close": all(close(a, b) for a, b in zip(grads, up_grads, strict=True)),
    }


MISMATCH = ([[1, 4, 6], [1, 2, 2]], [[1, 4, 6], [1, 2, 4]])  # per rank: the second image differs


def mismatch(rank: int) -> str:
    """On a rank of an initialised 2-rank group: the error the split raises when the ranks hold different images."""
    import torch.distributed as dist
    from verl.utils.ulysses import set_ulysses_sequence_parallel_group

    from verl_qwen3vl_plugin.patches.qwen3_vl_vision_dp.replacement import vision_dp_forward
    from verl_qwen3vl_plugin.selftest.tiny_models import pixel_values

    cls, tower = _towers()
    grid = torch.tensor(MISMATCH[rank])
    set_ulysses_sequence_parallel_group(dist.group.WORLD)
    try:
        vision_dp_forward(originals.original(cls, "forward"))(tower(), pixel_values(grid), grid)
    except RuntimeError as exc:
        return str(exc)
    finally:
        set_ulysses_sequence_parallel_group(None)
    return "no error"


def under_verls_own_dp(rank: int) -> bool:
    """On a rank of an initialised 2-rank group: on a class verl's own vision DP (verl#5230) marked, the plugin's
    forward runs upstream's on this rank's images as they are, with no split and no collective."""
    import torch.distributed as dist
    from verl.utils.ulysses import set_ulysses_sequence_parallel_group

    from verl_qwen3vl_plugin.patches.qwen3_vl_vision_dp.replacement import (
        VERL_VISION_DP_MARK,
        beside_verl_vision_dp,
        split_output,
    )
    from verl_qwen3vl_plugin.selftest.tiny_models import pixel_values

    cls, tower = _towers()
    upstream = originals.original(cls, "forward")
    grid = torch.tensor(MISMATCH[rank])  # verl's wrapper hands each rank other images
    model, pixels = tower(), pixel_values(grid)
    set_ulysses_sequence_parallel_group(dist.group.WORLD)
    setattr(cls, VERL_VISION_DP_MARK, True)
    try:
        ours = split_output(beside_verl_vision_dp(upstream)(model, pixels, grid))[0]
    except RuntimeError:
        return False
    finally:
        delattr(cls, VERL_VISION_DP_MARK)
        set_ulysses_sequence_parallel_group(None)
    return bool(torch.equal(ours, split_output(upstream(model, pixels, grid))[0]))


def _compare_cases(rank: int) -> dict:
    from verl_qwen3vl_plugin.selftest.tiny_models import has_qwen3_5

    results = {name: compare(grid) for name, grid in CASES.items()}
    if has_qwen3_5():
        results.update({f"{name} (qwen3_5)": compare(CASES[name], "qwen3_5") for name in QWEN3_5_CASES})
    return {**results, "mismatch": mismatch(rank), "verl's own DP": under_verls_own_dp(rank)}


def run() -> list[Check]:
    from verl_qwen3vl_plugin.patches.qwen3_vl_vision_dp.replacement import assign
    from verl_qwen3vl_plugin.selftest.ranks import on_two_ranks
    from verl_qwen3vl_plugin.selftest.tiny_models import VISION, has_qwen3_5

    results = on_two_ranks(_compare_cases, timeout=300)
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return [Check("vision DP on 2 ranks", False, errors[0].strip().splitlines()[-1])]
    checks = []
    cases = [(name, grid) for name, grid in CASES.items()]
    if has_qwen3_5():
        cases += [(f"{name} (qwen3_5)", CASES[name]) for name in QWEN3_5_CASES]
    for name, grid in cases:
        patches = [t * h * w for t, h, w in grid]
        shares = [sum(patches[s:e]) for s, e in assign(patches, 2)]
        dummy = VISION["spatial_merge_size"] ** 2  # what a rank without an image runs
        per_rank = [results[rank][name] for rank in (0, 1)]
        seen = [r["patches_seen"] for r in per_rank]
        ok = seen == [[share or dummy] for share in shares] and sum(shares) == sum(patches)
        ok = ok and all(r["outputs_close"] and r["grads_close"] for r in per_rank)
        detail = f"patches per rank {shares} of {sum(patches)}"
        checks.append(Check(f"vision DP on 2 ranks: {name}", ok, detail if ok else f"{detail}; {per_rank}"))
    errors = [results[rank]["mismatch"] for rank in (0, 1)]
    ok = errors[0] == errors[1] and "hold different images" in errors[0]
    checks.append(Check("vision DP on 2 ranks: different images raise on both", ok, errors[0][:160]))
    own = [results[rank]["verl's own DP"] for rank in (0, 1)]
    checks.append(
        Check("vision DP on 2 ranks: steps aside where verl's own vision DP wrapped the tower", all(own), own)
    )
    return checks
