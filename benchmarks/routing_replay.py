"""Benchmark: what routing replay does to the train / rollout mismatch, and what it costs.

A Qwen3-VL-MoE large enough for routing to matter (64 experts, top 8, 4 MoE layers; a 2-block tower) runs through
verl's own code on the CPU (verl 0.7's ``DataParallelPPOActor``, or verl >= 0.8's FSDP engine; one thread; the
stand-ins of ``verl_qwen3vl_plugin.selftest.ulysses``). The rollout stand-in's experts are packed as verl's agent
loop packs vLLM's record; the trainer runs in fp32 with replay off, then R3.

Mismatch: the fraction of recorded tokens routed to a different expert set in at least one layer, and the mean /
max |trainer log p - rollout log p| over response tokens; for a stand-in holding the weights in bf16 (as FSDP mixed
precision does), and for an fp32 one whose routers' weights are moved by 10% of their size (routing the only source
of mismatch). Overhead: one update forward + backward (``update_policy`` or ``forward_backward_batch``), replay off
and R3 alternating (ABBA), medians of ``--repeats``; the ratio is R3 / off.

    python benchmarks/routing_replay.py [--samples 32] [--repeats 9]
    python benchmarks/routing_replay.py --smoke   # 4 samples, one repeat: runs, no result
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time

import torch
import torch.distributed as dist

TEXT = dict(num_experts=64, num_experts_per_tok=8, num_hidden_layers=4, hidden_size=128, num_attention_heads=4,
            head_dim=32, moe_intermediate_size=64, vocab_size=160)  # fmt: skip
TOWER = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128)
GRIDS = [(1, 8, 8), (1, 4, 6), (1, 6, 4), (1, 4, 4)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--smoke", action="store_true", help="4 samples (one per grid), one repeat")
    args = parser.parse_args()
    if args.smoke:
        args.samples, args.repeats = len(GRIDS), 1
    import verl  # noqa: F401  (the plugin activates here)
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay import selftest as replay
    from verl_qwen3vl_plugin.selftest.ulysses import build_model, install_cpu_stand_ins

    install_cpu_stand_ins()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.set_num_threads(1)
    model = build_model("moe", text=TEXT, **TOWER)
    apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=False)
    batch = replay.batch_of([[GRIDS[i % len(GRIDS)]] for i in range(args.samples)])
    mask = batch["attention_mask"]
    if args.smoke:
        print("SMOKE RUN (smallest sizes, one repeat): it checks that the benchmark runs; its times are no result")
    print(f"verl {verl.__version__}: {args.samples} samples, {int(mask.sum())} tokens, trainer fp32")
    header = f"{'rollout stand-in':28} {'replay':6} {'routed unlike the rollout':>26}"
    print(f"{header} {'mean |dlogp|':>13} {'max |dlogp|':>12}")
    stand_ins = {"bf16 weights": dict(scale=0, dtype="bfloat16"), "fp32, routers moved 10%": dict(scale=0.1)}
    for label, how in stand_ins.items():
        record, rollout_lp = replay.rollout_stand_in(model, batch, **how)
        for name, mode in (("off", None), ("R3", "R3")):
            result, chosen = replay.routes_of(model, batch, mode=mode, record=record if mode else None)
            delta = (result["log_probs"] - rollout_lp).abs()
            frac = replay.mismatch(chosen, record, mask)
            print(f"{label:28} {name:6} {frac:>26.1%} {float(delta.mean()):>13.3e} {float(delta.max()):>12.3e}")
    record, _ = replay.rollout_stand_in(model, batch, scale=0, dtype="bfloat16")
    times = {"off": [], "R3": []}
    modes = [("off", None), ("R3", "R3")]
    for repeat in range(args.repeats + 1):  # the first of each: warm-up; the order alternates (ABBA)
        for name, mode in modes if repeat % 2 else modes[::-1]:
            start = time.perf_counter()
            replay.verl_pass(model, batch, mode=mode, record=record if mode else None, train=True)
            times[name].append(time.perf_counter() - start)
    off, r3 = (statistics.median(times[n][1:]) for n in ("off", "R3"))
    print(f"update forward + backward: off {off * 1e3:.1f} ms, R3 {r3 * 1e3:.1f} ms (medians of {args.repeats}), "
          f"R3 / off {r3 / off:.3f}; the record: {record.numel() * record.element_size() / 1e3:.1f} kB")  # fmt: skip


if __name__ == "__main__":
    main()
