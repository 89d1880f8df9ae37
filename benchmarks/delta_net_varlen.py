"""Benchmark: the plugin's varlen gated delta rule (``patches/qwen3_5_packed_delta_net/delta_net_varlen.py``) against
what verl 0.9 runs without flash-linear-attention: ``verl.models.transformers.qwen3_5._packed_chunk_gated_delta_rule``
over transformers' torch fallback. Which that is depends on transformers, so run it on two stacks:

- transformers <= 5.8 (the verl 0.9.0 + 5.8.1 stack): verl loops over the samples, one fallback call each (right);
- transformers >= 5.9 (the verl 0.9.1 + 5.10.4 stack): verl hands the fallback ``cu_seqlens``, which it ignores: one
  call over the whole row (fast and wrong: the samples mix).

One thread, 8 packed samples of 32 to 1024 tokens, one layer's rule at Qwen3.5's linear-attention head sizes (value
heads ``--heads``, key and value head dim 128), fp32 and bf16, forward and forward + backward. Implementations
alternate within each repeat; times are medians. Peak memory: resident growth during one call, in a fresh process
per measurement, less the output.

    python benchmarks/delta_net_varlen.py [--repeats 5] [--heads 16] [--no-memory]
    python benchmarks/delta_net_varlen.py --smoke   # 4 short samples, 2 heads, one repeat: runs, no result
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import time
from types import SimpleNamespace

import torch
from resident_memory import growth, in_child  # benchmarks/resident_memory.py, beside this script

LENGTHS = [1024, 32, 517, 96, 800, 64, 250, 1000]
SMOKE_LENGTHS = [130, 1, 64, 20]  # --smoke: across the 64-token chunks, one sample of a single token
DK = DV = 128
os.environ["VERL_QWEN3VL_PLUGIN_AUTOLOAD"] = "0"  # verl's function as verl ships it


def inputs(heads: int, dtype: torch.dtype, backward: bool) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    q, k = (torch.randn(1, total, heads, DK, generator=generator).to(dtype) for _ in range(2))
    v = torch.randn(1, total, heads, DV, generator=generator).to(dtype)
    g = -torch.rand(1, total, heads, generator=generator)  # fp32 log decays, as the layer computes them
    beta = torch.rand(1, total, heads, generator=generator).to(dtype)
    return tuple(x.requires_grad_(backward) for x in (q, k, v, g, beta))


def implementations() -> dict:
    """{name: rule(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu) -> output}, verl first, named by what it does."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule
    from verl.models.transformers.qwen3_5 import _packed_chunk_gated_delta_rule

    from verl_qwen3vl_plugin.patches.qwen3_5_packed_delta_net.delta_net_varlen import (
        chunk_gated_delta_rule,
        layout_for,
        lengths_of,
    )

    layer = SimpleNamespace(chunk_gated_delta_rule=torch_chunk_gated_delta_rule)

    def verl(q, k, v, g, beta, cu, cu_cpu):
        return _packed_chunk_gated_delta_rule(layer, q, k, v, g, beta, cu, cu_cpu)[0]

    def plugin(q, k, v, g, beta, cu, cu_cpu):  # as packed_delta_net calls it: one layout per packing, for all layers
        return chunk_gated_delta_rule(q, k, v, g, beta, layout_for(tuple(lengths_of(cu, cu_cpu)), q.device))

    # **kwargs (transformers >= 5.9): verl's keyword check passes, and the fallback ignores cu_seqlens
    mixes = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(torch_chunk_gated_delta_rule).parameters.values())
    return {"verl single row (samples mix)" if mixes else "verl per-sample loop": verl, "plugin varlen": plugin}


def call(rule, args: tuple, backward: bool) -> torch.Tensor:
    cu_cpu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    if not backward:
        with torch.no_grad():
            return rule(*args, cu_cpu, cu_cpu)
    out = rule(*args, cu_cpu, cu_cpu)
    out.float().sum().backward()
    return out


def time_case(heads: int, dtype: torch.dtype, backward: bool, repeats: int) -> dict[str, float]:
    impls = implementations()
    args = inputs(heads, dtype, backward)
    for rule in impls.values():  # warm-up
        call(rule, args, backward)
    times: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(repeats):
        for name, rule in impls.items():
            for x in args:
                x.grad = None
            start = time.perf_counter()
            call(rule, args, backward)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def use_smoke_lengths() -> None:
    global LENGTHS
    LENGTHS = SMOKE_LENGTHS


def memory_child(impl: str, heads: int, dtype: str, backward: bool) -> float:
    """In a fresh process: peak resident growth during one call, less the output, in bytes."""
    torch.set_num_threads(1)
    rule = implementations()[impl]
    args = inputs(heads, getattr(torch, dtype), backward)
    grown, out = growth(lambda: call(rule, args, backward))
    return grown - out.numel() * out.element_size()


def peak_memory(impl: str, heads: int, dtype: str, backward: bool, *args: str) -> float:
    return in_child(__file__, [impl, heads, dtype, backward], *args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="4 short samples, 2 heads, one repeat, one memory case")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.smoke:
        use_smoke_lengths()
        args.heads, args.repeats = 2, 1
    if args.memory_child:
        print(memory_child(*json.loads(args.memory_child)))
        return
    import transformers
    import verl

    upstream, plugin = implementations()
    if args.smoke:
        print("SMOKE RUN (smallest sizes, one repeat): it checks that the benchmark runs; its times are no result")
    print(f"verl {verl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}, CPU "
          f"{torch.backends.cpu.get_cpu_capability()}, 1 thread; samples {LENGTHS} ({sum(LENGTHS)} tokens), "
          f"{args.heads} heads, head dim {DK}; medians of {args.repeats}, alternating")  # fmt: skip
    print(f"ratio = {upstream} / {plugin}")
    cases = [(dtype, backward) for dtype in ("float32", "bfloat16") for backward in (False, True)]
    for case, (dtype, backward) in enumerate(cases):
        times = time_case(args.heads, getattr(torch, dtype), backward, args.repeats)
        line = (f"{dtype:8} {'fwd+bwd' if backward else 'fwd':7} {upstream} {times[upstream] * 1e3:8.0f} ms, "
                f"plugin {times[plugin] * 1e3:8.0f} ms, ratio {times[upstream] / times[plugin]:.2f}x")  # fmt: skip
        if not args.no_memory and not (args.smoke and case):  # a smoke run measures one case's memory
            smoke = ["--smoke"] * args.smoke
            mem = {name: peak_memory(name, args.heads, dtype, backward, *smoke) for name in (upstream, plugin)}
            line += f"; peak extra MiB {mem[upstream] / 2**20:.0f} vs {mem[plugin] / 2**20:.0f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
