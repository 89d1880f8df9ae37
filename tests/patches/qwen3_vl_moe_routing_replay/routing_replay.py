"""Routing replay through verl's own actor (0.7.x) or FSDP engine (>= 0.8) on a tiny Qwen3-VL-MoE with images (or,
``single qwen3_5_moe``, a tiny Qwen3.5-MoE: a gated delta-net layer, then a full-attention one, both MoE).

    routing_replay.py single [moe|qwen3_5_moe]
                               one process: R3, R2, the gate's gradient, dynamic batches, checkpointing, bad input
    routing_replay.py control  one process, run with the patch disabled: replay off's numbers, and whether R3 replays
    routing_replay.py ranks    two gloo ranks, FSDP2, different data per rank (R3); then SP = 2 against SP = 1

Prints one JSON object. CPU stand-ins: ``verl_qwen3vl_plugin.selftest.ulysses`` names them; the rollout stand-in:
``verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay.selftest``.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from ulysses_ranks import error_of, one_rank_group, shard  # tests/_child, on every child's PYTHONPATH

from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay import selftest as replay
from verl_qwen3vl_plugin.selftest.ranks import on_two_ranks
from verl_qwen3vl_plugin.selftest.ulysses import install_cpu_stand_ins

SMALL = 0.1  # the rollout stand-in's router-weight perturbation: a few routing flips per layer


def train_grads(model, batch, **kwargs):
    model.zero_grad(set_to_none=True)
    result, chosen = replay.routes_of(model, batch, train=True, **kwargs)
    return result, chosen, result["gate_grads"]


def single(kind):
    model, batch = replay.build(kind), replay.batch_of()
    mask = batch["attention_mask"]
    out = {}
    record, rollout_lp = replay.rollout_stand_in(model, batch, SMALL)
    off, chosen_off = replay.routes_of(model, batch)
    r3, chosen_r3 = replay.routes_of(model, batch, mode="R3", record=record)
    recorded_rows = mask.bool() & ~replay.last_tokens(mask)
    out["r3_equals_record"] = bool(torch.equal(chosen_r3[recorded_rows], record.long()[recorded_rows]))
    out["mismatch_off"], out["mismatch_r3"] = (replay.mismatch(c, record, mask) for c in (chosen_off, chosen_r3))
    for name, result in (("off", off), ("r3", r3)):
        delta = (result["log_probs"] - rollout_lp).abs()
        out[f"dlogp_mean_{name}"], out[f"dlogp_max_{name}"] = float(delta.mean()), float(delta.max())
    # R2: the old-log-prob pass records the model's own routes; the update replays them bit for bit
    r2 = replay.verl_pass(model, batch, mode="R2")
    real = mask.bool()
    out["r2_records_own"] = bool(torch.equal(r2["recorded"][real].long(), chosen_off[real]))
    out["r2_record_dtype"] = str(r2["recorded"].dtype)
    update, chosen_update, grads_r2 = train_grads(model, batch, mode="R2", record=r2["recorded"])
    out["r2_update_equals_record_pass"] = bool(torch.equal(update["log_probs"], r2["log_probs"]))
    out["r2_update_routes_recorded"] = bool(torch.equal(chosen_update[real], r2["recorded"][real].long()))
    # the gate's gradient under replay of the model's own routes is upstream's own routing gradient
    _, _, grads_off = train_grads(model, batch)
    out["gate_grad_nonzero"] = all(bool(g.abs().sum() > 0) for g in grads_r2.values())
    out["gate_grad_max_rel_diff"] = max(
        float((grads_r2[n] - g).abs().max() / g.abs().max()) for n, g in grads_off.items()
    )
    # R3 under training, with and without activation checkpointing
    r3_train, chosen_train, grads_r3 = train_grads(model, batch, mode="R3", record=record)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ckpt, chosen_ckpt, grads_ckpt = train_grads(model, batch, mode="R3", record=record)
    model.gradient_checkpointing_disable()
    out["r3_train_equals_record"] = bool(torch.equal(chosen_train[recorded_rows], record.long()[recorded_rows]))
    out["checkpointing_recompute_same"] = ckpt["recompute_same"]
    out["checkpointing_routes_same"] = bool(torch.equal(chosen_ckpt, chosen_train))
    out["checkpointing_log_prob_diff"] = float((ckpt["log_probs"] - r3_train["log_probs"]).abs().max())
    out["checkpointing_grad_diff"] = max(float((grads_ckpt[n] - g).abs().max()) for n, g in grads_r3.items())
    # dynamic batching: micro-batches reordered, routes and log-probs back in batch order
    dyn_r2 = replay.verl_pass(model, batch, mode="R2", dynamic=True)
    out["dynamic_r2_record_same"] = bool(torch.equal(dyn_r2["recorded"], r2["recorded"]))
    dyn_r3 = replay.verl_pass(model, batch, mode="R3", record=record, dynamic=True)
    out["dynamic_r3_log_prob_diff"] = float((dyn_r3["log_probs"] - r3["log_probs"]).abs().max())
    # vLLM >= 0.22 (<= 256 experts), 0.14, verl's as_dict
    out["dtypes_replayed"] = {str(dtype): replays(model, batch, record.to(dtype)) for dtype in DTYPES}
    out["errors"] = bad_inputs(model, batch, record)
    out["fallback"] = fallback_metric(model, batch, record)
    out["worker_r2_returns_record"] = worker_r2(model, batch, r2["recorded"])
    out["off"] = off_numbers(model, batch)
    return out


def worker_r2(model, batch, recorded):
    """verl 0.7's worker ``compute_log_prob`` (on an object holding what it reads) returns the R2 pass's routes as
    ``routed_experts``, as its Megatron worker does; None on verl >= 0.8 (no such worker: the engine returns them)."""
    try:
        from verl.workers import fsdp_workers
    except ImportError:
        return None
    from contextlib import nullcontext
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    rollout = dict(log_prob_micro_batch_size_per_gpu=2, log_prob_max_token_len_per_gpu=96, temperature=1.0)
    worker = SimpleNamespace(
        _is_actor=True, _is_offload_param=False, world_size=1, ulysses_sharding_manager=nullcontext(),
        actor=replay.replay_actor(model, "R2", batch["input_ids"].shape[0]), tokenizer=SimpleNamespace(pad_token_id=0),
        config=OmegaConf.create({"rollout": {**rollout, "log_prob_use_dynamic_bsz": False}}),
    )  # fmt: skip
    output = fsdp_workers.ActorRolloutRefWorker.compute_log_prob(worker, replay.actor_data(batch))
    return bool(torch.equal(output.batch["routed_experts"], recorded))


def bad_inputs(model, batch, record):
    experts = replay.TEXT["num_experts"]
    out_of_range = record.clone()
    out_of_range[0, -3, 1, 0] = experts
    cases = {
        "r3_without_record": dict(mode="R3"),
        "r2_with_record": dict(mode="R2", record=record),
        "layers": dict(mode="R3", record=record[:, :, :1]),
        "top_k": dict(mode="R3", record=record[..., :1]),
        "length": dict(mode="R3", record=record[:, 1:]),
        "expert_id": dict(mode="R3", record=out_of_range),
        "float_record": dict(mode="R3", record=record.float()),
        "mode": dict(mode="R4"),
        "shifted_later": dict(mode="R3", record=shifted(record, 1)),
        "shifted_earlier": dict(mode="R3", record=shifted(record, -2)),
        "zero_layer": dict(mode="R3", record=zero_rows(record, batch, layer=1)),
    }
    return {name: error_of(lambda kw=kw: replay.verl_pass(model, batch, **kw)) for name, kw in cases.items()}


DTYPES = (torch.uint8, torch.int32, torch.int64)


def replays(model, batch, record):
    """Whether R3 routes every recorded token as ``record`` says."""
    rows = batch["attention_mask"].bool() & ~replay.last_tokens(batch["attention_mask"])
    _, chosen = replay.routes_of(model, batch, mode="R3", record=record)
    return bool(torch.equal(chosen[rows], record.long()[rows]))


def shifted(record, rows):
    """The record moved ``rows`` tokens later (negative: earlier), as an image expanded into more (fewer)
    placeholder tokens by the rollout engine than by the processor shifts it."""
    out = torch.zeros_like(record)
    if rows > 0:
        out[:, rows:] = record[:, :-rows]
    else:
        out[:, :rows] = record[:, -rows:]
    return out


def zero_rows(record, batch, layer=None, every=None):
    """The record with no route (verl's zeros) on one MoE layer for every token, or on every ``every``-th token
    the engine ran, every layer: what an engine that skips its router hook returns."""
    out = record.clone()
    if layer is not None:
        out[:, :, layer] = 0
    else:
        ran = batch["attention_mask"].bool() & ~replay.last_tokens(batch["attention_mask"])
        rows = ran.flatten().nonzero().flatten()[::every]
        out.view(-1, *out.shape[2:])[rows] = 0
    return out


def fallback_metric(model, batch, record):
    """The update's ``routing_replay/fallback_fraction`` on a record missing every 7th row the engine ran, with the
    threshold lifted; and what those rows are of all the rollout ran."""
    from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay.rollout_record import MAX_FALLBACK_ENV

    holey = zero_rows(record, batch, every=7)
    ran = batch["attention_mask"].bool() & ~replay.last_tokens(batch["attention_mask"])
    os.environ[MAX_FALLBACK_ENV] = "1"
    try:
        result, chosen, _ = train_grads(model, batch, mode="R3", record=holey)
    finally:
        del os.environ[MAX_FALLBACK_ENV]
    metric = result["metrics"]["routing_replay/fallback_fraction"]
    missing = ran & (holey == 0).all(-1).all(-1)
    own = chosen[missing]  # the model's own routes, never expert 0 twice
    return {
        "metric": metric[0] if isinstance(metric, list) else metric,
        "expected": float(missing.sum() / ran.sum()),
        "missing_rows_routed_by_model": bool((own.sort(-1).values.diff(dim=-1) != 0).all()),
    }


def off_numbers(model, batch):
    """Replay off: the log-probs, the update's log-probs and the gate's gradient, exactly."""
    result = replay.verl_pass(model, batch)
    update, _, grads = train_grads(model, batch)
    return {
        "log_probs": result["log_probs"].tolist(),
        "update_log_probs": update["log_probs"].tolist(),
        "gate_grads": {n: g.tolist() for n, g in grads.items()},
    }


def control():
    model, batch = replay.build(), replay.batch_of()
    mask = batch["attention_mask"]
    record, _ = replay.rollout_stand_in(model, batch, SMALL)
    _, chosen = replay.routes_of(model, batch, mode="R3", record=record)
    rows = mask.bool() & ~replay.last_tokens(mask)
    return {"r3_equals_record": bool(torch.equal(chosen[rows], record.long()[rows])), "off": off_numbers(model, batch)}


# Per rank its own samples for the FSDP2 data-parallel check, as many per rank (verl splits them alike).
RANK_SAMPLES = ([[(1, 4, 4)], [(1, 2, 2), (1, 4, 6)]], [[], [(1, 2, 4), (1, 2, 2)]])


def on_rank(rank):
    install_cpu_stand_ins()
    model = replay.build()
    out = {}
    # SP = 2 (both ranks hold the same batch, the world is the Ulysses group) against SP = 1, with replay
    from verl.utils.ulysses import set_ulysses_sequence_parallel_group

    batch = replay.batch_of()
    record, _ = replay.rollout_stand_in(model, batch, SMALL)
    sp1, _, grads1 = train_grads(model, batch, mode="R3", record=record)
    set_ulysses_sequence_parallel_group(dist.group.WORLD)
    try:
        model.zero_grad(set_to_none=True)
        sp2 = replay.verl_pass(model, batch, mode="R3", record=record, train=True, sp=2)
        grads2 = sp2["gate_grads"]
        r2_sp2 = replay.verl_pass(model, batch, mode="R2", sp=2)
    finally:
        set_ulysses_sequence_parallel_group(None)
    r2_sp1 = replay.verl_pass(model, batch, mode="R2")
    out["sp_log_prob_diff"] = float((sp2["log_probs"] - sp1["log_probs"]).abs().max())
    for g in grads2.values():  # averaged over the ranks, as FSDP reduces them (verl's gather scales by SP)
        dist.all_reduce(g)
        g /= dist.get_world_size()
    out["sp_gate_grad_rel_diff"] = max(float((grads2[n] - g).abs().max() / g.abs().max()) for n, g in grads1.items())
    out["sp_r2_record_same"] = bool(torch.equal(r2_sp2["recorded"], r2_sp1["recorded"]))
    # FSDP2 over both ranks, each with its own data: R3 replays each rank's record exactly, and nothing hangs
    batch = replay.batch_of(RANK_SAMPLES[rank])
    record, _ = replay.rollout_stand_in(replay.build(), batch, SMALL)  # the same seeded weights, unsharded
    shard(model)
    mask = batch["attention_mask"]
    _, chosen = replay.routes_of(model, batch, mode="R3", record=record)
    rows = mask.bool() & ~replay.last_tokens(mask)
    out["fsdp2_r3_equals_record"] = bool(torch.equal(chosen[rows], record.long()[rows]))
    result, chosen, _ = train_grads(model, batch, mode="R3", record=record)
    out["fsdp2_r3_train_equals_record"] = bool(torch.equal(chosen[rows], record.long()[rows]))
    return out


if __name__ == "__main__":
    import verl  # noqa: F401  (the plugin activates here, as in a user's worker)

    part, *kind = sys.argv[1:]
    if part == "ranks":
        print(json.dumps(on_two_ranks(on_rank, timeout=900)))
    else:
        install_cpu_stand_ins()
        one_rank_group()
        print(json.dumps(single(*kind or ["moe"]) if part == "single" else control()))
