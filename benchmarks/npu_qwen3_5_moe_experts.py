"""Measurement: what verl's Ascend Qwen3.5-MoE experts forward (``npu_patch.qwen3_5_moe_experts_forward_npu``, verl
0.8.0 to 0.9.1) pays for the ``.permute(0, 2, 1).contiguous()`` of both expert weights in every forward, on the CPU
reference ``torch_npu`` ops (``selftest/npu_reference.py``), one Qwen3.5-35B-A3B layer's shape (256 experts, top-8,
hidden 2048, expert intermediate 512), bf16. Needs a stack with verl >= 0.8 and transformers >= 5.2.

What carries over to an NPU: the bytes. The copies write a second copy of the layer's expert weights per forward
(and read the first), and verl's ``NPUGmmFunction`` saves the copies for backward, so without activation
checkpointing every layer's copy stays alive from its forward to its backward: bytes counted here with
``saved_tensors_hooks``. What does not carry over: the CPU times (the reference grouped matmul is a loop of
matmuls); they are printed as the copy's share of this CPU forward, alternating copy and forward, medians.

    python benchmarks/npu_qwen3_5_moe_experts.py [--tokens 512] [--repeats 5]   # about 40 s per forward here
    python benchmarks/npu_qwen3_5_moe_experts.py --smoke   # a small layer, 16 tokens, one repeat: runs, no result
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch

E, TOP_K, HIDDEN, INTER, LAYERS = 256, 8, 2048, 512, 40  # Qwen3.5-35B-A3B
os.environ["VERL_QWEN3VL_PLUGIN_AUTOLOAD"] = "0"  # verl's forward as verl ships it


def use_smoke_shape() -> None:
    """``--smoke``: a layer of the same structure, small enough that a forward takes milliseconds."""
    global E, TOP_K, HIDDEN, INTER
    E, TOP_K, HIDDEN, INTER = 8, 2, 64, 32


def experts(dtype: torch.dtype):
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts

    config = type("Config", (), dict(num_experts=E, hidden_size=HIDDEN, moe_intermediate_size=INTER, hidden_act="silu"))
    module = Qwen3_5MoeExperts(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(std=0.02)
    return module.to(dtype)


def inputs(tokens: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, HIDDEN, generator=generator).to(dtype).requires_grad_()
    ids = torch.rand(tokens, E, generator=generator).topk(TOP_K, dim=-1).indices
    weights = torch.rand(tokens, TOP_K, generator=generator).softmax(-1).to(dtype)
    return hidden, ids, weights


def saved_bytes(forward, module, args) -> tuple[int, int]:
    """(bytes autograd saves for backward, of those the bytes that are no parameter's storage: the copies)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward(module, *args)
    return sum(seen.values()), sum(n for ptr, n in seen.items() if ptr not in params)


def copies(module) -> None:
    module.gate_up_proj.permute(0, 2, 1).contiguous()
    module.down_proj.permute(0, 2, 1).contiguous()


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[512])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="a small layer, 16 tokens, one repeat")
    args = parser.parse_args()
    if args.smoke:
        use_smoke_shape()
        args.tokens, args.repeats = [16], 1
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe  # noqa: F401
    import verl  # noqa: F401  (both first: their device probes must find no torch_npu)

    from verl_qwen3vl_plugin.selftest.npu_reference import fake_torch_npu

    with contextlib.ExitStack() as stack:
        stack.enter_context(fake_torch_npu())
        from verl.models.transformers import npu_patch

        forward = npu_patch.qwen3_5_moe_experts_forward_npu
        dtype = torch.bfloat16
        module = experts(dtype)
        weight_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        gib = 2**30
        if args.smoke:
            print("SMOKE RUN (smallest sizes, one repeat): it checks that the benchmark runs; its times are no result")
        print(f"torch {torch.__version__}, CPU {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} "
              f"thread(s); one layer: {E} experts, hidden {HIDDEN}, intermediate {INTER}, {dtype}")  # fmt: skip
        unsharded = "unsharded, as FSDP gathers them for the layer's forward"
        print(f"expert weights per layer: {weight_bytes / gib:.2f} GiB; {LAYERS} layers: "
              f"{LAYERS * weight_bytes / gib:.1f} GiB ({unsharded})")  # fmt: skip
        for tokens in args.tokens:
            batch = inputs(tokens, dtype)
            total, copied = saved_bytes(forward, module, batch)
            times = {"forward": [], "copies": []}
            for _ in range(args.repeats):
                with torch.no_grad():
                    times["forward"].append(timed(lambda batch=batch: forward(module, *batch)))
                    times["copies"].append(timed(lambda: copies(module)))
            fwd, cp = (statistics.median(times[k]) for k in ("forward", "copies"))
            print(f"\n{tokens} tokens x top-{TOP_K}:")
            print(f"  saved for backward: {total / gib:.2f} GiB, of which outside the parameters' storage (the weight "
                  f"copies, and activations) {copied / gib:.2f} GiB ({copied / weight_bytes:.2f}x the layer's expert "
                  "weights)")  # fmt: skip
            print(
                f"  per forward the copies write {weight_bytes / gib:.2f} GiB and read as much; without activation "
                f"checkpointing {LAYERS} layers hold {LAYERS * copied / gib:.1f} GiB of copies until backward"
            )
            print(f"  CPU (reference ops, not NPU times): forward {fwd * 1e3:.0f} ms, the two copies {cp * 1e3:.0f} ms "
                  f"({cp / fwd:.0%} of the forward), median of {args.repeats}, alternating")  # fmt: skip


if __name__ == "__main__":
    main()
