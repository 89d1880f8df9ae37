"""Benchmark: sparse Qwen3-VL-MoE experts against upstream, one Qwen3-VL-30B-A3B block shape (128 experts, top-8,
hidden 2048, expert intermediate 768), measured in the same run.

Cases (``--case``, repeatable; default: the three transformers 4.57 / verl cases):
- ``eval``: the plugin's grouped experts against transformers 4.57's dense eval path (no grad), the log-prob pass;
- ``train``: forward + backward against transformers 4.57's training loop;
- ``npu-eval``: verl's NPU experts on the CPU reference ``torch_npu`` ops, the plugin's grouped eval against verl's
  dense eval (needs verl's npu_patch: a stack with verl 0.7.1 + transformers 4.57);
- ``tf5``: transformers 5's own ``grouped_mm`` experts against its eager loop (the anchor; a transformers 5 stack).

Ratios alternate implementations within each repeat and take medians. Peak memory (eval passes) is measured in a
fresh process per implementation: the resident-set high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs``) minus the resident set before the call, less the output. FLOPs per log-prob pass come
from the shapes.

    python benchmarks/moe_experts.py [--tokens 256 1024] [--dtypes float32 bfloat16] [--repeats 3] [--case eval]
    python benchmarks/moe_experts.py --smoke   # a small block, 16 tokens, one repeat: runs, no result
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
from resident_memory import growth, in_child  # benchmarks/resident_memory.py, beside this script

E, TOP_K, HIDDEN, INTER, LAYERS = 128, 8, 2048, 768, 48
_KEEP = contextlib.ExitStack()
# Upstream must stay upstream: the plugin's start-up hook would patch these classes at ``import verl``.
os.environ["VERL_QWEN3VL_PLUGIN_AUTOLOAD"] = "0"


def use_smoke_shape() -> None:
    """``--smoke``: a block of the same structure, small enough that every case takes a second."""
    global E, TOP_K, HIDDEN, INTER
    E, TOP_K, HIDDEN, INTER = 8, 2, 64, 32


def config(dtype: torch.dtype):
    from verl_qwen3vl_plugin.selftest.tiny_models import tiny_qwen3_vl_moe_config

    text = dict(num_experts=E, num_experts_per_tok=TOP_K, hidden_size=HIDDEN, moe_intermediate_size=INTER)
    return tiny_qwen3_vl_moe_config(**text).text_config


def experts_module(cls: type, dtype: torch.dtype) -> torch.nn.Module:
    module = cls(config(dtype))
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02, generator=torch.Generator().manual_seed(0))
    return module.to(dtype)


def routed(tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from verl_qwen3vl_plugin.patches.qwen3_vl_moe_sparse_experts.selftest import routed_inputs

    return routed_inputs(config(dtype), tokens=tokens, dtype=dtype)


def implementations(case: str) -> tuple[type, dict[str, Callable]]:
    """The experts class and {name: forward(experts, hidden, routing, indices)} for a case; upstream first."""
    if case in ("eval", "train"):
        from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as m

        from verl_qwen3vl_plugin.patches.qwen3_vl_moe_sparse_experts.replacement import sparse_experts_forward

        return m.Qwen3VLMoeTextExperts, {
            "transformers": m.Qwen3VLMoeTextExperts.forward,
            "plugin": sparse_experts_forward,
        }
    if case == "npu-eval":
        import transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe  # noqa: F401
        import verl  # noqa: F401  (both first: their device probes must find no torch_npu)

        from verl_qwen3vl_plugin.patches.npu_qwen3_vl_moe_sparse_eval.replacement import grouped_eval_forward
        from verl_qwen3vl_plugin.selftest.npu_reference import fake_torch_npu

        _KEEP.enter_context(fake_torch_npu())  # for the rest of this process: verl's npu_patch imports torch_npu
        from verl.models.transformers import npu_patch

        cls = npu_patch.NPUQwen3VLMoeTextExperts
        return cls, {"verl": cls.forward, "plugin": grouped_eval_forward(cls.forward, npu_patch.NPUGmmFunction)}
    if case == "tf5":
        from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as m

        def with_impl(name: str) -> Callable:
            def forward(experts, hidden, routing, indices):
                experts.config._experts_implementation = name
                return experts(hidden.reshape(-1, HIDDEN), indices, routing.gather(1, indices))

            return forward

        return m.Qwen3VLMoeTextExperts, {"eager": with_impl("eager"), "grouped_mm": with_impl("grouped_mm")}
    raise ValueError(f"unknown case {case!r}")


def call(fn: Callable, experts, inputs, backward: bool) -> torch.Tensor:
    hidden, routing, indices = inputs
    if not backward:
        with torch.no_grad():
            return fn(experts, hidden, routing, indices)
    experts.zero_grad(set_to_none=True)
    hidden, routing = hidden.clone().requires_grad_(), routing.clone().requires_grad_()
    out = fn(experts, hidden, routing, indices)
    out.backward(torch.ones_like(out))
    return out


def time_case(case: str, tokens: int, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    cls, impls = implementations(case)
    experts, inputs = experts_module(cls, dtype), routed(tokens, dtype)
    if case == "tf5":
        experts.config = config(dtype)
    backward = case == "train"
    experts.train(backward)
    times: dict[str, list[float]] = {name: [] for name in impls}
    for fn in impls.values():  # warm-up
        call(fn, experts, routed(8, dtype), backward)
    for _ in range(repeats):
        for name, fn in impls.items():
            start = time.perf_counter()
            call(fn, experts, inputs, backward)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def memory_child(case: str, impl: str, tokens: int, dtype: str) -> float:
    """In a fresh process: peak resident growth during one eval call, less the output, in bytes."""
    torch.set_num_threads(1)
    cls, impls = implementations(case)
    experts, inputs = experts_module(cls, getattr(torch, dtype)), routed(tokens, getattr(torch, dtype))
    experts.eval()
    call(impls[impl], experts, routed(8, getattr(torch, dtype)), False)
    grown, out = growth(lambda: call(impls[impl], experts, inputs, False))
    return grown - out.numel() * out.element_size()


def peak_memory(case: str, impl: str, tokens: int, dtype: str, *args: str) -> float:
    return in_child(__file__, [case, impl, tokens, dtype], *args)


def flops_per_token() -> tuple[float, float]:
    """Expert FLOPs per token per layer: every expert (dense eval) and the top-k (sparse), 2 FLOPs per MAC."""
    per_expert = 2 * (HIDDEN * 2 * INTER + INTER * HIDDEN)
    return E * per_expert, TOP_K * per_expert


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train-repeats", type=int, default=1, help="transformers' loop takes minutes per call")
    parser.add_argument("--case", action="append", choices=["eval", "train", "npu-eval", "tf5"])
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="a small block, 16 tokens, one repeat, one dtype's memory")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        use_smoke_shape()
        args.tokens, args.repeats, args.train_repeats = [16], 1, 1
    if args.memory_child:
        print(memory_child(*json.loads(args.memory_child)))
        return
    torch.set_num_threads(1)
    if args.smoke:
        print("SMOKE RUN (smallest sizes, one repeat): it checks that the benchmark runs; its times are no result")
    dense, sparse = flops_per_token()
    block = "a small" if args.smoke else "Qwen3-VL-30B-A3B"
    print(f"{block} block: {E} experts, top-{TOP_K}, hidden {HIDDEN}, expert intermediate {INTER}")
    print(f"expert GFLOP per token per log-prob pass ({LAYERS} layers): dense eval {dense * LAYERS / 1e9:.1f}, "
          f"sparse {sparse * LAYERS / 1e9:.2f} ({dense / sparse:.0f}x)")  # fmt: skip
    print(f"CPU, 1 thread; ratio = upstream median / plugin median, alternating, {args.repeats} repeats "
          f"({args.train_repeats} for train)\n")  # fmt: skip
    memory_dtypes = args.dtypes[:1] if args.smoke else args.dtypes  # a smoke run: fewer processes of their own
    for case in args.case or ["eval", "train", "npu-eval"]:
        for dtype in args.dtypes:
            for tokens in args.tokens:
                repeats = args.train_repeats if case == "train" else args.repeats
                times = time_case(case, tokens, getattr(torch, dtype), repeats)
                (upstream, t_up), (ours, t_ours) = times.items()
                line = f"{case:9} {dtype:8} {tokens:5} tokens: {upstream} {t_up:8.3f} s  {ours} {t_ours:8.3f} s  "
                line += f"ratio {t_up / t_ours:6.1f}x"
                if case in ("eval", "npu-eval") and not args.no_memory and dtype in memory_dtypes:
                    mem = {name: peak_memory(case, name, tokens, dtype, *["--smoke"] * args.smoke) for name in times}
                    line += f"  peak extra memory {mem[ours] / 2**20:7.1f} MiB vs {mem[upstream] / 2**20:8.1f} MiB"
                    if mem[upstream] > 0:  # a smoke run's block can leave nothing resident
                        line += f" ({mem[ours] / mem[upstream]:.3f} of {upstream})"
                print(line, flush=True)


if __name__ == "__main__":
    main()
