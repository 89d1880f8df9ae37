"""GPU checks of the interpolation patch, for a session lent a CUDA device. One process, one GPU, ~1 minute.

Needs torch with CUDA, transformers 4.57.x to 5.8.x (the versions whose vision forward calls the method; the
original report is on 4.57.6), and this package. verl >= 0.8 is optional: its in-tree version joins the timings.

  1. FSDP2 with CPU offload (``fully_shard`` + ``CPUOffloadPolicy``, ``pos_embed`` in its own unit as verl wraps it)
     on a tiny Qwen3-VL vision tower: forward + backward fails with the device mismatch with transformers' method,
     and works with the plugin's, whose gradient reaches the offloaded table.
  2. Device-to-host syncs per call, counted with ``torch.cuda.set_sync_debug_mode``: exactly 1.
  3. CUDA-event timings against the upstream implementations on 64 geo3k-like images (goal: >= 20x vs verl's).
  4. Sparse Qwen3-VL-MoE experts (transformers 4.57.x only), one Qwen3-VL-30B-A3B block, bf16: CUDA-event timings of
     eval against the dense path and forward + backward against the loop, at 256 and 1024 tokens, and host syncs
     per call (0 on the grouped-GEMM path). Written without a GPU at hand: not yet run.

    python benchmarks/gpu_check.py        # exits 1 if a check fails
    python benchmarks/gpu_check.py --smoke   # on the CPU, any machine: what of each check runs without CUDA (smoke)
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import warnings

import torch
import torch.distributed as dist


def check_fsdp2_cpu_offload() -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    from verl_qwen3vl_plugin.patches.qwen3_vl_pos_embed.replacement import fast_pos_embed_interpolate
    from verl_qwen3vl_plugin.selftest.tiny_models import VISION, pixel_values

    upstream = Qwen3VLVisionModel.__dict__["fast_pos_embed_interpolate"]
    mesh = init_device_mesh("cuda", (1,))
    grid = torch.tensor([[1, 4, 6], [2, 8, 8]], device="cuda")
    pixels = pixel_values(grid.cpu()).cuda()
    outcome = {}
    for name, fn in (("transformers", upstream), ("plugin", fast_pos_embed_interpolate)):
        Qwen3VLVisionModel.fast_pos_embed_interpolate = fn
        torch.manual_seed(0)
        model = Qwen3VLVisionModel(Qwen3VLVisionConfig(**VISION))
        for module in [model.pos_embed, *model.blocks, model]:
            fully_shard(module, mesh=mesh, offload_policy=CPUOffloadPolicy())
        try:
            tower_step(model, pixels, grid)
            grad = model.pos_embed.weight.grad
            outcome[name] = f"ok (table grad on {grad.device}, finite: {bool(torch.isfinite(grad.to_local()).all())})"
        except RuntimeError as exc:
            outcome[name] = f"RuntimeError: {str(exc).splitlines()[0]}"
    Qwen3VLVisionModel.fast_pos_embed_interpolate = upstream
    for name, result in outcome.items():
        print(f"  FSDP2 + CPU offload, {name:12}: {result}")
    return "device" in outcome["transformers"] and outcome["plugin"].startswith("ok")


def tower_step(model: torch.nn.Module, pixels: torch.Tensor, grid: torch.Tensor) -> None:
    """Check 1's forward + backward of the vision tower (its merged output, whichever type transformers returns)."""
    out = model(pixels, grid_thw=grid)
    out = out[0] if isinstance(out, tuple) else getattr(out, "pooler_output", out)
    out.float().square().sum().backward()


def geo3k_grid(n: int, device: str = "cuda") -> torch.Tensor:
    rng = random.Random(0)
    return torch.tensor([[1, 2 * rng.randint(8, 32), 2 * rng.randint(8, 32)] for _ in range(n)], device=device)


def pos_embed_impls() -> dict:
    """The plugin's interpolation and the upstream ones installed here (check 3, and the smoke run)."""
    from verl_qwen3vl_plugin.patches.qwen3_vl_pos_embed.replacement import fast_pos_embed_interpolate
    from verl_qwen3vl_plugin.patches.qwen3_vl_pos_embed.selftest import references

    return {"plugin": fast_pos_embed_interpolate, **references()}


def check_syncs() -> bool:
    from verl_qwen3vl_plugin.patches.qwen3_vl_pos_embed.replacement import fast_pos_embed_interpolate
    from verl_qwen3vl_plugin.selftest.tiny_models import vision_tower

    model, grid = vision_tower(hidden=1152).cuda(), geo3k_grid(64)
    fast_pos_embed_interpolate(model, grid)  # warm-up: the grid tables are copied to the device once
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        fast_pos_embed_interpolate(model, grid)
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    print(f"  device-to-host syncs in one call: {len(syncs)}")
    for w in syncs:
        print(f"    {w.filename}:{w.lineno}: {str(w.message).splitlines()[0]}")
    return len(syncs) == 1


def check_timings(repeats: int = 10) -> bool:
    from verl_qwen3vl_plugin.selftest.tiny_models import vision_tower

    impls = pos_embed_impls()
    grid = geo3k_grid(64)
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        model = vision_tower(hidden=1152, dtype=dtype).cuda()
        for backward in (False, True):
            times = {name: [] for name in impls}
            for _ in range(repeats + 1):  # the first round warms up
                for name, fn in impls.items():
                    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    model.zero_grad(set_to_none=True)
                    start.record()
                    if backward:
                        fn(model, grid).float().sum().backward()
                    else:
                        with torch.no_grad():
                            fn(model, grid)
                    stop.record()
                    torch.cuda.synchronize()
                    times[name].append(start.elapsed_time(stop))
            median = {name: statistics.median(ts[1:]) for name, ts in times.items()}
            ratios = "  ".join(f"{n} {median[n]:8.2f} ms ({median[n] / median['plugin']:5.1f}x)" for n in impls)
            print(f"  64 images, hidden 1152, {str(dtype)[6:]:8} {'fwd+bwd' if backward else 'fwd':7}: {ratios}")
            if "verl" in median and not backward and median["verl"] / median["plugin"] < 20:
                ok = False
    return ok


def moe_impls() -> tuple[type, dict] | None:
    """The experts class and {name: forward} for check 4; None where this transformers' experts are sparse already."""
    from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as m

    from verl_qwen3vl_plugin.patches.qwen3_vl_moe_sparse_experts.replacement import sparse_experts_forward

    if not hasattr(m.Qwen3VLMoeTextExperts.forward, "__code__") or "router_indices" not in (
        m.Qwen3VLMoeTextExperts.forward.__code__.co_varnames
    ):
        return None
    return m.Qwen3VLMoeTextExperts, {"transformers": m.Qwen3VLMoeTextExperts.forward, "plugin": sparse_experts_forward}


def check_moe_experts(repeats: int = 5) -> bool:
    from moe_experts import experts_module, routed  # benchmarks/moe_experts.py, beside this script

    found = moe_impls()
    if found is None:
        print("  skipped: this transformers' experts are sparse already")
        return True
    cls, impls = found
    sparse_experts_forward = impls["plugin"]
    experts = experts_module(cls, torch.bfloat16).cuda()
    for tokens in (256, 1024):
        hidden, routing, indices = (t.cuda() for t in routed(tokens, torch.bfloat16))
        for backward in (False, True):
            experts.train(backward)
            times = {name: [] for name in impls}
            for _ in range(repeats + 1):  # the first round warms up
                for name, fn in impls.items():
                    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    experts.zero_grad(set_to_none=True)
                    h, r = hidden.clone().requires_grad_(backward), routing.clone().requires_grad_(backward)
                    start.record()
                    with torch.set_grad_enabled(backward):
                        out = fn(experts, h, r, indices)
                        if backward:
                            out.float().sum().backward()
                    stop.record()
                    torch.cuda.synchronize()
                    times[name].append(start.elapsed_time(stop))
            median = {name: statistics.median(ts[1:]) for name, ts in times.items()}
            ratio = median["transformers"] / median["plugin"]
            mode = "fwd+bwd" if backward else "eval"
            print(f"  {tokens} tokens {mode:7}: transformers {median['transformers']:8.2f} ms, "
                  f"plugin {median['plugin']:8.2f} ms ({ratio:.1f}x)")  # fmt: skip
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        experts.eval()
        with torch.no_grad():
            sparse_experts_forward(experts, hidden, routing, indices)
        torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    print(f"  host syncs per plugin eval call: {len(syncs)}")
    return True


def smoke() -> int:
    """``--smoke``, on the CPU whatever the machine has, in seconds: every module the checks import, and what of each
    check runs without CUDA, once. Check 1: the tower's forward + backward with the plugin's method, unsharded (FSDP2's
    CPU offload needs a CUDA device); checks 2 and 3: every implementation on 4 geo3k-like images, forward and forward
    + backward, fp32 and bf16; check 4: the experts of a small block (``moe_experts.use_smoke_shape``), eval and
    forward + backward. Not run: the offload, the sync counts, the CUDA-event timings and their goals."""
    import moe_experts  # benchmarks/moe_experts.py, beside this script
    from torch.distributed.device_mesh import init_device_mesh  # noqa: F401  (check 1's: imported, not run)
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard  # noqa: F401
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    from verl_qwen3vl_plugin.selftest.tiny_models import VISION, pixel_values, vision_tower

    print(f"SMOKE RUN on the CPU (torch {torch.__version__}): what each check runs without CUDA; no check's result")
    impls = pos_embed_impls()
    upstream = Qwen3VLVisionModel.__dict__["fast_pos_embed_interpolate"]
    grid = torch.tensor([[1, 4, 6], [2, 8, 8]])
    Qwen3VLVisionModel.fast_pos_embed_interpolate = impls["plugin"]
    try:
        torch.manual_seed(0)
        model = Qwen3VLVisionModel(Qwen3VLVisionConfig(**VISION))
        tower_step(model, pixel_values(grid), grid)
    finally:
        Qwen3VLVisionModel.fast_pos_embed_interpolate = upstream
    finite = bool(torch.isfinite(model.pos_embed.weight.grad).all())
    print(f"  fsdp2_cpu_offload: the tower's forward + backward, plugin's method, unsharded; grad finite: {finite}")
    grid = geo3k_grid(4, device="cpu")
    for dtype in (torch.float32, torch.bfloat16):
        model = vision_tower(hidden=16, dtype=dtype)
        for fn in impls.values():
            with torch.no_grad():
                fn(model, grid)
            fn(model, grid).float().sum().backward()
    print(f"  syncs, timings: {', '.join(impls)}, forward and forward + backward, 4 images, fp32 and bf16")
    found = moe_impls()
    if found is None:
        print("  moe_experts: skipped: this transformers' experts are sparse already")
    else:
        cls, moe = found
        moe_experts.use_smoke_shape()
        experts, inputs = moe_experts.experts_module(cls, torch.bfloat16), moe_experts.routed(16, torch.bfloat16)
        for backward in (False, True):
            experts.train(backward)
            for fn in moe.values():
                moe_experts.call(fn, experts, inputs, backward)
        print(f"  moe_experts: {', '.join(moe)}, eval and forward + backward, a small block, 16 tokens, bf16")
    return 0 if finite else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="on the CPU: what of each check runs without CUDA")
    args = parser.parse_args()
    if args.smoke:
        return smoke()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    results = {}
    for name, check in (("fsdp2_cpu_offload", check_fsdp2_cpu_offload), ("syncs", check_syncs),
                        ("timings", check_timings), ("moe_experts", check_moe_experts)):  # fmt: skip
        print(f"{name}:")
        try:
            results[name] = check()
        except Exception as exc:  # report every check, even after one crashed
            print(f"  crashed: {type(exc).__name__}: {exc}")
            results[name] = False
    dist.destroy_process_group()
    print("result: " + ", ".join(f"{n} {'ok' if r else 'FAILED'}" for n, r in results.items()))
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
