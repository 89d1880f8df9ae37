"""GPU check of the packed gated delta rule (``qwen3_5_packed_delta_net``), for a session lent a CUDA device. One
process, one GPU, about a minute. Needs torch with CUDA, transformers with Qwen3.5 (its torch fallback is the
reference), and this package; not verl (its loop is a per-sample loop over that fallback, written out here).

  1. Correctness on CUDA, fp32: 8 packed samples (one of 1 token, one of 20) against each sample alone through
     transformers' fallback, forward and gradients; the single-row fallback (verl 0.9 on transformers >= 5.9)
     against the same reference, to show the mixing.
  2. CUDA-event timings, alternating, medians, and peak memory: the plugin's varlen rule against verl 0.9's
     per-sample loop (transformers <= 5.8) and against the single-row fallback; 8 samples of 32 to 1024 tokens, 32
     value heads of 128 (Qwen3.5's), fp32 and bf16, forward and forward + backward. Goal: >= 2x the loop.
  3. Host syncs: none for a layer's call once its packing's layout is built; building it copies the indices to the
     device once per micro-batch (2 syncs seen on an H200: the copy from pageable memory).

    python benchmarks/gpu_delta_net.py        # exits 1 if a check fails
    python benchmarks/gpu_delta_net.py --smoke   # on the CPU, any machine: check 1, each implementation once (smoke)
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import warnings

import torch

from verl_qwen3vl_plugin.patches.qwen3_5_packed_delta_net.delta_net_varlen import (
    chunk_gated_delta_rule,
    layout_for,
)

LENGTHS = [1024, 32, 517, 96, 800, 64, 250, 1000]
CHECK_LENGTHS = [37, 90, 1, 64, 20, 130, 0, 65]
HEADS, DIM = 32, 128
DEVICE = "cuda"  # "cpu" for --smoke


def fallback():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    return torch_chunk_gated_delta_rule


def inputs(lengths: list[int], heads: int, dtype: torch.dtype, grad: bool, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(1, total, heads, DIM, device=DEVICE, generator=generator).to(dtype) for _ in range(3))
    g = -torch.rand(1, total, heads, device=DEVICE, generator=generator)
    beta = torch.rand(1, total, heads, device=DEVICE, generator=generator).to(dtype)
    return tuple(x.requires_grad_(grad) for x in (q, k, v, g, beta))


def loop(q, k, v, g, beta, lengths):
    """verl 0.9's split on transformers <= 5.8: one fallback call per sample."""
    rule, out, start = fallback(), [], 0
    for n in lengths:
        if n:
            s = slice(start, start + n)
            out.append(rule(q[:, s], k[:, s], v[:, s], g=g[:, s], beta=beta[:, s], use_qk_l2norm_in_kernel=True)[0])
        start += n
    return torch.cat(out, dim=1)


def single_row(q, k, v, g, beta, lengths):
    """verl 0.9 on transformers >= 5.9 without FLA: the fallback over the whole row (the bounds ignored)."""
    return fallback()(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]


def plugin(q, k, v, g, beta, lengths):
    """As ``packed_delta_net`` calls it: the layout built once per packing (verl hands the bounds' host copy)."""
    return chunk_gated_delta_rule(q, k, v, g, beta, layout_for(tuple(lengths), q.device))


IMPLS = {"verl per-sample loop": loop, "single row (mixes)": single_row, "plugin varlen": plugin}


def check_correctness() -> bool:
    args = inputs(CHECK_LENGTHS, 8, torch.float32, True, seed=1)
    weights = torch.randn(1, sum(CHECK_LENGTHS), 8, DIM, device=DEVICE)
    reference = loop(*args, CHECK_LENGTHS)
    expected = torch.autograd.grad((reference * weights).sum(), args)
    ok = True
    for name in ("plugin varlen", "single row (mixes)"):
        out = IMPLS[name](*args, CHECK_LENGTHS)
        grads = torch.autograd.grad((out * weights).sum(), args)
        diff = float((out - reference).detach().abs().max())
        grad = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(grads, expected, strict=True))
        print(f"  {name:20} vs each sample alone: output max diff {diff:.2e}, gradient max rel diff {grad:.2e}")
        if name == "plugin varlen":
            ok &= diff < 1e-4 and grad < 1e-4
    return ok


def run(fn, args: tuple, lengths: list[int], backward: bool) -> None:
    if backward:
        for x in args:
            x.grad = None
        fn(*args, lengths).float().sum().backward()
    else:
        with torch.no_grad():
            fn(*args, lengths)


def check_timings(repeats: int = 10) -> bool:
    ok = True
    print(f"  {len(LENGTHS)} samples {LENGTHS}, {HEADS} heads x {DIM}; CUDA events, median of {repeats}, alternating")
    for dtype in (torch.float32, torch.bfloat16):
        for backward in (False, True):
            args = inputs(LENGTHS, HEADS, dtype, backward)
            times: dict[str, list[float]] = {name: [] for name in IMPLS}
            peak = {}
            for name, fn in IMPLS.items():  # warm-up, and peak memory above what is allocated before the call
                run(fn, args, LENGTHS, backward)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                run(fn, args, LENGTHS, backward)
                torch.cuda.synchronize()
                peak[name] = (torch.cuda.max_memory_allocated() - before) / 2**20
            for _ in range(repeats):
                for name, fn in IMPLS.items():
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    run(fn, args, LENGTHS, backward)
                    end.record()
                    torch.cuda.synchronize()
                    times[name].append(start.elapsed_time(end))
            med = {name: statistics.median(ts) for name, ts in times.items()}
            mode = "fwd+bwd" if backward else "fwd"
            line = ", ".join(f"{name} {med[name]:.1f} ms ({peak[name]:.0f} MiB)" for name in IMPLS)
            vs_loop = med["verl per-sample loop"] / med["plugin varlen"]
            vs_row = med["plugin varlen"] / med["single row (mixes)"]
            print(
                f"  {str(dtype)[6:]:8} {mode:7} {line}; loop / plugin {vs_loop:.2f}x, plugin / single row {vs_row:.2f}x"
            )
            ok &= vs_loop >= 2
    return ok


def check_syncs() -> bool:
    args = inputs(LENGTHS[::-1], HEADS, torch.bfloat16, False)
    counts = []
    for _ in range(2):  # a new packing, then the next layer's call
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            plugin(*args, LENGTHS[::-1])
            torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(w.message) for w in caught))
    print(f"  host syncs: {counts[0]} for a new packing, {counts[1]} for the next layer's call")
    return counts[1] == 0


def smoke() -> int:
    """``--smoke``, on the CPU whatever the machine has: check 1 as it is (its tolerance included), then each
    implementation once on check 1's packing in fp32 and bf16, forward and forward + backward. Not run: the CUDA-event
    timings, peak memory and their goal (check 2), the sync counts (check 3)."""
    global DEVICE
    DEVICE = "cpu"
    print("SMOKE RUN on the CPU: check 1, and what of check 2 runs without CUDA; no timing")
    print("correctness:", flush=True)
    ok = check_correctness()
    for dtype, backward in itertools.product((torch.float32, torch.bfloat16), (False, True)):
        args = inputs(CHECK_LENGTHS, 2, dtype, backward)
        for fn in IMPLS.values():
            run(fn, args, CHECK_LENGTHS, backward)
    print(f"  {', '.join(IMPLS)}: forward and forward + backward on {CHECK_LENGTHS}, fp32 and bf16")
    print(f"correctness: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="on the CPU: check 1, and each implementation once")
    if parser.parse_args().smoke:
        return smoke()
    import transformers

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}")
    results = {}
    for name, check in (("correctness", check_correctness), ("timings", check_timings), ("syncs", check_syncs)):
        print(f"{name}:", flush=True)
        results[name] = check()
    print("; ".join(f"{name}: {'ok' if ok else 'FAILED'}" for name, ok in results.items()))
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
