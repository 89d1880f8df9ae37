"""Benchmark: what the plugin buys end to end, one actor step of verl with every patch on against every patch off.

Each patch has a benchmark of the code it replaces; this one measures them together where verl runs them: verl
0.7.1's real ``DataParallelPPOActor``, ``compute_log_prob`` with entropy (as verl's worker calls it), then
``update_policy`` (one optimizer step, learning rate 0, so every step does the same work), on two gloo ranks of 1
thread each, Ulysses SP = 2, FSDP2 (``tests/_child/ulysses_ranks.shard``), with the CPU stand-ins of
``verl_qwen3vl_plugin.selftest.ulysses``. The model is a small Qwen3-VL-MoE (``BENCH_TOWER``, ``BENCH_TEXT``); the
batch alternates samples of 1 and 2 geo3k-sized images, in micro-batches of 4, one mini-batch.

The patches install at ``import verl``, so the two modes cannot share ranks: each repeat starts a fresh pair of
ranks with the plugin on, then a fresh pair with ``VERL_QWEN3VL_PLUGIN_DISABLE=all``, both without any other plugin
switch in their environment (as ``tests/helpers.py`` starts its children); each rank checks that it runs the mode it
was started for. Each pair makes ``--warmup`` untimed steps, then times one; a call's time is the slower rank's (the
step waits for it). The table shows the medians per call over the pairs, the off / on ratio, and each rank's peak
resident set. The ratio is what the patches save at these shapes on a CPU, not a forecast for a 30B model on
accelerators, where the shares of vision, experts and attention in a step differ.

Each rank checks the plugin-on mode against the probes of the installed stack (``registry.decide_installed``): a
target whose probe says apply must be applied, or pending where the rank never imported its module; no other target
may be applied.

    python benchmarks/end_to_end.py [--samples 8] [--repeats 5] [--warmup 1]
    python benchmarks/end_to_end.py --smoke   # one pair per mode, one micro-batch, no warm-up: runs, checks, no result
"""

from __future__ import annotations

import argparse
import itertools
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from vision_dp import GEO3K_GRIDS  # benchmarks/vision_dp.py, beside this script: the same image sizes

from verl_qwen3vl_plugin.registry import DISABLE_ENV

# ``ulysses_ranks`` (tests/_child/ulysses_ranks.py) is imported from its folder, not as ``tests.``: verl's wheel
# installs a ``tests`` package of its own, which shadows this repository's outside pytest
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests" / "_child"))

SP, MICRO = 2, 4
# Small, but with Qwen3-VL-30B-A3B's proportions where the patches act: a 4-block tower, experts at E / top_k = 8.
BENCH_TOWER = dict(depth=4, hidden_size=128, intermediate_size=512, num_heads=4, out_hidden_size=64,
                   deepstack_visual_indexes=[1])  # fmt: skip
BENCH_TEXT = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32)  # fmt: skip
PLUGIN_SWITCHES = ("VERL_USE_EXTERNAL", "VERL_QWEN3VL_PLUGIN")  # stripped before every pair, as tests/helpers.py
CALLS = ("compute_log_prob", "update_policy")


def samples_of(count: int) -> list[list[tuple[int, int, int]]]:
    """``count`` samples of 1 and 2 images in turn, the images taking the geo3k grids in turn."""
    grids = itertools.cycle(GEO3K_GRIDS)
    return [[next(grids) for _ in range(1 + i % 2)] for i in range(count)]


def _expected_mistakes() -> list[str]:
    """With the plugin on: every way the statuses in this process differ from what the probes decide on the installed
    stack. A target the probe says apply to must be applied, or pending where this process never imported its module
    (verl's critic, its new engine workers and rollout here); no other target may be applied; nothing may fail."""
    from verl_qwen3vl_plugin import Status, patch_statuses
    from verl_qwen3vl_plugin.patches import PATCHES
    from verl_qwen3vl_plugin.registry import Verdict, decide_installed

    statuses = {(s.patch, s.target): s for s in patch_statuses()}
    wrong = []
    for patch in PATCHES:
        for target in patch.targets:
            decision = decide_installed(patch, target)
            status = statuses.get((patch.name, target.label))
            found = status.status if status else None
            where = f"{patch.name} on {target.label}: {found.value if found else 'not watched'}"
            if decision.verdict is Verdict.APPLY:
                if found is Status.PENDING and target.module in sys.modules:
                    wrong.append(f"{where}, its module imported, and its probe says apply")
                elif found not in (Status.APPLIED, Status.PENDING):
                    wrong.append(f"{where}, but its probe says apply")
            elif found in (Status.APPLIED, Status.FAILED):
                wrong.append(f"{where}, but its probe says {decision.verdict.value}")
    return wrong


def _check_mode(plugin: bool, tower: type) -> list[str]:
    """The names of the applied patches; raises unless the rank runs the mode it was started for: with the plugin
    on, the patches the installed stack's probes call for (``_expected_mistakes``), and the vision tower's forward
    the plugin's exactly where vision DP applies to it; with it off, nothing applied."""
    from verl_qwen3vl_plugin import Status, patch_statuses
    from verl_qwen3vl_plugin.originals import ours as plugin_set
    from verl_qwen3vl_plugin.patches import spec
    from verl_qwen3vl_plugin.registry import Verdict, decide_installed

    applied = sorted({s.patch for s in patch_statuses() if s.status is Status.APPLIED})
    ours = plugin_set(tower.forward)  # a wrapper carries upstream's name and module (functools.wraps)
    if plugin:
        vision_dp = spec("qwen3_vl_vision_dp")
        wraps_tower = decide_installed(vision_dp, vision_dp.target(tower.__module__)).verdict is Verdict.APPLY
        wrong = _expected_mistakes()
        if wrong or ours != wraps_tower:
            raise RuntimeError(f"plugin on, but: {wrong}; vision forward the plugin's: {ours}, expected {wraps_tower}")
    elif applied or ours:
        raise RuntimeError(f"plugin off, but applied: {applied}; vision forward the plugin's: {ours}")
    return applied


def _timed(call: Callable[[], object]) -> float:
    """Seconds ``call`` took on the slower rank."""
    dist.barrier()
    start = time.perf_counter()
    call()
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _rank(rank: int, plugin: bool, samples: int, warmup: int) -> dict:
    """On one of the two ranks: the last step's times, this rank's peak RSS, the applied patches, the tokens."""
    import verl  # noqa: F401  (the plugin activates here, unless disabled)
    from tensordict import TensorDict
    from ulysses_ranks import shard
    from verl import DataProto
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.utils.ulysses import set_ulysses_sequence_parallel_group

    from verl_qwen3vl_plugin.selftest.ulysses import actor_for, build_model, install_cpu_stand_ins, micro_batch

    install_cpu_stand_ins()
    model = build_model("moe", text=BENCH_TEXT, **BENCH_TOWER)
    apply_monkey_patch(model, ulysses_sp_size=SP, use_remove_padding=True, use_fused_kernels=False)
    shard(model)
    set_ulysses_sequence_parallel_group(dist.group.WORLD)  # the SP group, as verl's sharding manager sets it
    actor = actor_for(model, SP, ppo_mini_batch_size=samples, ppo_micro_batch_size_per_gpu=MICRO)
    applied = _check_mode(plugin, type(model.model.visual))
    batch = micro_batch(samples_of(samples))
    responses = batch["responses"]
    advantages = torch.randn(responses.shape, generator=torch.Generator().manual_seed(2))
    keys = ("input_ids", "attention_mask", "position_ids", "responses")
    tensors = {key: batch[key] for key in keys} | {"response_mask": torch.ones_like(responses)}
    data = DataProto(
        batch=TensorDict(tensors, batch_size=[samples]),
        non_tensor_batch={"multi_modal_inputs": batch["multi_modal_inputs"]},
        meta_info={"micro_batch_size": MICRO, "temperature": 1.0, "use_dynamic_bsz": False, "pad_token_id": 0},
    )
    out = {}

    def log_prob() -> None:
        out.update(actor.compute_log_prob(data, calculate_entropy=True))

    def update() -> None:
        data.batch["old_log_probs"], data.batch["advantages"] = out["log_probs"], advantages
        actor.update_policy(data)

    for _ in range(warmup + 1):  # only the last step's times are kept
        times = {"compute_log_prob": _timed(log_prob), "update_policy": _timed(update)}
    return {
        **times,
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "applied": applied,
        "tokens": int(batch["attention_mask"].sum()),
    }


def pair(plugin: bool, samples: int, warmup: int) -> list[dict]:
    """A fresh pair of ranks in one mode: each rank's result, in rank order."""
    from verl_qwen3vl_plugin.selftest.ranks import on_two_ranks

    for key in [key for key in os.environ if key.startswith(PLUGIN_SWITCHES)]:
        del os.environ[key]
    if not plugin:
        os.environ[DISABLE_ENV] = "all"
    results = on_two_ranks(_rank, plugin, samples, warmup, timeout=3600)
    errors = [result["error"] for result in results if "error" in result]
    if errors:
        raise RuntimeError("\n".join(errors))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="one pair per mode, one micro-batch, no warm-up")
    args = parser.parse_args()
    if args.smoke:
        args.samples, args.repeats, args.warmup = MICRO, 1, 0
    start = time.perf_counter()
    runs = {True: [], False: []}
    for _ in range(args.repeats):
        for plugin in runs:
            runs[plugin].append(pair(plugin, args.samples, args.warmup))
    total = time.perf_counter() - start

    def median(plugin: bool, key: str, rank: int = 0) -> float:
        return statistics.median(ranks[rank][key] for ranks in runs[plugin])

    grids = [grid for images in samples_of(args.samples) for grid in images]
    patches = sum(t * h * w for t, h, w in grids)
    if args.smoke:
        print("SMOKE RUN (smallest sizes, one repeat): it checks that the benchmark runs; its times are no result")
    print(f"CPU, 2 gloo ranks x 1 thread, Ulysses SP = {SP}, FSDP2, small Qwen3-VL-MoE (4-block tower, "
          f"16 experts top-2), {args.samples} samples, "
          f"{len(grids)} images ({patches} patches), {runs[True][0][0]['tokens']} tokens, micro-batches of {MICRO}; "
          f"medians of {args.repeats} alternating pairs of ranks per mode, {args.warmup} warm-up step(s) each, "
          f"{total:.0f} s in all")  # fmt: skip
    print(f"plugin on: {', '.join(runs[True][0][0]['applied'])}")
    print(f"{'':<20}{'plugin off':>12}{'plugin on':>12}{'off / on':>10}")
    for call in CALLS:
        off, on = median(False, call), median(True, call)
        print(f"{call:<20}{off:>10.3f} s{on:>10.3f} s{off / on:>9.2f}x")
    for rank in range(2):
        off, on = median(False, "rss_mib", rank), median(True, "rss_mib", rank)
        print(f"{f'peak RSS rank {rank}':<20}{off:>8.0f} MiB{on:>8.0f} MiB{off / on:>9.2f}x")


if __name__ == "__main__":
    main()
