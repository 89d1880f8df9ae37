"""Checks of the ``qwen3_vl_moe_routing_replay`` patch, through verl's own code: verl 0.7's
``DataParallelPPOActor.compute_log_prob`` / ``update_policy``, or verl >= 0.8's ``FSDPEngine.forward_backward_batch``
(``ulysses.engine_for``), on a tiny Qwen3-VL-MoE with images, and on a tiny Qwen3.5-MoE (a gated delta-net layer,
then a full-attention one, both MoE) where verl and transformers have it.

The rollout stand-in is the same model with perturbed weights, run through the same verl forward with replay off;
the experts each of its MoE layers is handed (a hook on the experts module, not the plugin's record) are packed as
verl's agent loop packs vLLM's ``routed_experts``: (bsz, prompt + response, layers, top_k) int16, row s for
``input_ids[s]`` of the left-padded prompt, zeros for padding and for each sample's last token (the rollout engine
never runs the token it sampled last).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json

import torch
from torch import nn

from verl_qwen3vl_plugin.selftest import Check, in_child

# Per sample its images as (t, h, w) grids, videos as ("v", t, h, w), then text (``ulysses.micro_batch``): left
# padding, a sample without vision, a video.
SAMPLES = [[(1, 4, 4)], [(1, 2, 2), (1, 4, 6)], [], [("v", 2, 2, 4)]]
TEXT = dict(num_experts=8, num_experts_per_tok=2)  # a real top-k choice in each of the two MoE layers
GATES = ".mlp.gate.weight"  # the routers' weights (a Linear's on transformers 4.57, the top-k router's on 5.x)
INDEX_PARAMETERS = ("router_indices", "top_k_index")  # the experts' ids argument: transformers 4.57, 5.x


def experts_modules(model: nn.Module) -> list[nn.Module]:
    return [layer.mlp.experts for layer in model.model.language_model.layers]


@contextlib.contextmanager
def chosen_experts(model: nn.Module):
    """Per MoE layer, the expert ids its experts module is handed, per call: what the model actually routed."""
    chosen: list[list[torch.Tensor]] = []
    handles = []
    for i, experts in enumerate(experts_modules(model)):
        names = list(inspect.signature(type(experts).forward).parameters)[1:]
        position = next(names.index(n) for n in INDEX_PARAMETERS if n in names)
        chosen.append([])
        handles.append(
            experts.register_forward_pre_hook(lambda _, args, i=i, p=position: chosen[i].append(args[p].detach()))
        )
    try:
        yield chosen
    finally:
        for handle in handles:
            handle.remove()


def gate_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """The routers' weight gradients (full tensors under FSDP2)."""
    grads = {}
    for name, p in model.named_parameters():
        if name.endswith(GATES) and p.grad is not None:
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name] = grad.detach().clone()
    return grads


def in_batch_layout(per_layer: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """Packed (tokens, top_k) ids per layer as (bsz, seqlen, layers, top_k), -1 where no token is."""
    bsz, seqlen = mask.shape
    packed = torch.stack(per_layer, dim=1)
    out = torch.full((bsz * seqlen, *packed.shape[1:]), -1, dtype=torch.long)
    out[mask.flatten().nonzero().flatten()] = packed.long()
    return out.view(bsz, seqlen, *packed.shape[1:])


def last_tokens(mask: torch.Tensor) -> torch.Tensor:
    """(bsz, seqlen) True at each sample's last real token."""
    last = torch.zeros_like(mask, dtype=torch.bool)
    last[torch.arange(mask.shape[0]), mask.shape[1] - 1 - mask.flip(-1).int().argmax(-1)] = True
    return last


def build(kind: str = "moe") -> nn.Module:
    """The tiny model (``moe``: Qwen3-VL-MoE, ``qwen3_5_moe``: Qwen3.5-MoE) after verl's ``apply_monkey_patch`` (its
    attention and Ulysses wrappers, SP up to 2)."""
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    from verl_qwen3vl_plugin.selftest.ulysses import build_model

    model = build_model(kind, text=TEXT)
    apply_monkey_patch(model, ulysses_sp_size=2, use_remove_padding=True, use_fused_kernels=False)
    return model


def perturbed(model: nn.Module, scale: float, only: str = "", seed: int = 7) -> nn.Module:
    """A copy whose weights (those whose name holds ``only``) are moved by ``scale`` of their own size: the rollout
    engine's other numerics."""
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in other.named_parameters():
            noise = torch.randn(p.shape, generator=generator) * p.abs().mean() * scale
            if only in name:
                p.add_(noise)
    return other


def batch_of(samples=SAMPLES) -> dict:
    from verl_qwen3vl_plugin.selftest.ulysses import micro_batch

    return micro_batch(samples)


def rollout_stand_in(
    model: nn.Module, batch: dict, scale: float = 0.05, dtype: str = "float32", only: str = GATES
) -> tuple[torch.Tensor, torch.Tensor]:
    """(routed_experts as verl's agent loop packs them, the stand-in's response log-probs): the model with its
    weights (by default the routers') moved by ``scale``, held and run in ``dtype`` (a bf16 rollout engine:
    ``scale=0, dtype="bfloat16"``, as FSDP mixed precision holds it). Perturbing only the routers makes routing the
    one source of mismatch."""
    rollout = perturbed(model, scale, only) if scale else copy.deepcopy(model)
    rollout = rollout.to(getattr(torch, dtype))
    with chosen_experts(rollout) as chosen:
        result = verl_pass(rollout, batch, dtype=dtype)
    result["log_probs"] = result["log_probs"].float()
    record = in_batch_layout([torch.cat(calls) for calls in chosen], batch["attention_mask"]).clamp(min=0)
    record[last_tokens(batch["attention_mask"])] = 0
    return record.to(torch.int16), result["log_probs"]


def _response_log_probs(packed: torch.Tensor, batch: dict) -> torch.Tensor:
    """Packed per-token log-probs (verl >= 0.8's nested output) as (bsz, response): token t's log-prob sits at t-1."""
    mask = batch["attention_mask"]
    full = torch.zeros(mask.numel(), dtype=packed.dtype)
    full[mask.flatten().nonzero().flatten()] = packed
    response = batch["responses"].shape[1]
    return full.view(mask.shape)[:, -response - 1 : -1]


def verl_pass(
    model: nn.Module,
    batch: dict,
    mode: str | None = None,
    record: torch.Tensor | None = None,
    train: bool = False,
    sp: int = 1,
    dynamic: bool = False,
    dtype: str = "float32",
) -> dict:
    """One verl log-prob pass (``train``: the update's forward and backward) with ``router_replay.mode`` = ``mode``,
    under verl's autocast to ``dtype``: {"log_probs": (bsz, response), "recorded": an R2 pass's routes (bsz, seqlen,
    layers, top_k) or None, and for ``train`` "gate_grads"}."""
    try:
        from verl.workers.actor import dp_actor  # noqa: F401  (verl 0.7.x)
    except ImportError:
        return _engine_run(model, batch, mode, record, train, sp, dynamic, dtype)
    return _actor_run(model, batch, mode, record, train, sp, dynamic, dtype)


def actor_data(batch: dict, record: torch.Tensor | None = None, train: bool = False, dynamic: bool = False):
    """``batch`` as verl's worker hands it to the actor: a ``DataProto`` with its images, the record and, for an
    update, old log-probs and seeded advantages."""
    from tensordict import TensorDict
    from verl import DataProto

    bsz, response = batch["responses"].shape
    tensors = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")}
    tensors["response_mask"] = torch.ones_like(batch["responses"])
    if record is not None:
        tensors["routed_experts"] = record
    if train:
        tensors["old_log_probs"] = torch.zeros(bsz, response)
        tensors["advantages"] = torch.randn(bsz, response, generator=torch.Generator().manual_seed(2))
    meta = {"micro_batch_size": 2, "temperature": 1.0, "use_dynamic_bsz": dynamic, "max_token_len": 96}
    meta["pad_token_id"] = 0
    non_tensor = {"multi_modal_inputs": batch["multi_modal_inputs"]}
    return DataProto(batch=TensorDict(tensors, batch_size=[bsz]), non_tensor_batch=non_tensor, meta_info=meta)


def replay_actor(
    model: nn.Module, mode: str | None, bsz: int, sp: int = 1, dynamic: bool = False, dtype: str = "float32"
):
    """verl 0.7's ``DataParallelPPOActor`` with ``router_replay.mode`` = ``mode``: one mini-batch of ``bsz``,
    micro-batches of 2."""
    from verl.workers.config.actor import RouterReplayConfig

    from verl_qwen3vl_plugin.selftest.ulysses import actor_for

    config = dict(router_replay=RouterReplayConfig(mode=mode or "disabled"), ppo_mini_batch_size=bsz)
    config.update(ppo_micro_batch_size_per_gpu=2, use_dynamic_bsz=dynamic, ppo_max_token_len_per_gpu=96)
    return actor_for(model, sp, dtype, **config)


def _actor_run(model, batch, mode, record, train, sp, dynamic, dtype) -> dict:
    from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay.dp_actor import take_recorded

    actor = replay_actor(model, mode, batch["input_ids"].shape[0], sp, dynamic, dtype)
    data = actor_data(batch, record, train, dynamic)
    if not train:
        out = actor.compute_log_prob(data, calculate_entropy=False)
        log_probs = out["log_probs"] if isinstance(out, dict) else out[0]  # 0.7.0: (log_probs, entropys)
        return {"log_probs": log_probs.detach(), "recorded": take_recorded(actor)}
    captured = []
    forward = actor._forward_micro_batch

    def capturing(micro_batch, *args, **kwargs):
        result = forward(micro_batch, *args, **kwargs)
        log_probs = result["log_probs"] if isinstance(result, dict) else result[1]
        captured.append((micro_batch["input_ids"], log_probs.detach().clone()))
        return result

    grads = {}
    actor._forward_micro_batch = capturing
    actor.actor_optimizer.step = lambda *args, **kwargs: grads.update(gate_grads(model))  # verl zeroes them after
    metrics = actor.update_policy(data)
    return {"log_probs": _in_batch_order(captured, batch), "recorded": None, "gate_grads": grads, "metrics": metrics}


def _in_batch_order(captured: list, batch: dict) -> torch.Tensor:
    """The update's micro-batch log-probs back in batch order (rows found by their input ids)."""
    rows = {}
    for ids, log_probs in captured:
        for sample_ids, lp in zip(ids, log_probs, strict=True):
            rows[tuple(sample_ids.tolist())] = lp
    return torch.stack([rows[tuple(ids.tolist())] for ids in batch["input_ids"]])


def _engine_run(model, batch, mode, record, train, sp, dynamic, dtype) -> dict:
    from verl.utils import tensordict_utils as tu

    from verl_qwen3vl_plugin.selftest.ulysses import engine_batch, engine_for

    engine = engine_for(model, sp, router_replay={"mode": mode or "disabled"})
    engine._autocast_dtype = getattr(torch, dtype)
    data = engine_batch(batch, **({"routed_experts": record} if record is not None else {}))
    settings = dict(use_dynamic_bsz=dynamic, max_token_len_per_gpu=96, micro_batch_size_per_gpu=2)
    for key, value in settings.items():
        tu.assign_non_tensor_data(data, key, value)
    real = [tuple(t[m.bool()].tolist()) for t, m in zip(batch["input_ids"], batch["attention_mask"], strict=True)]
    weights = [torch.randn(len(ids), generator=torch.Generator().manual_seed(2 + i)) for i, ids in enumerate(real)]
    captured = {}

    def loss_function(model_output, data, dp_group):
        loss = 0.0
        for ids, log_probs in zip(data["input_ids"].unbind(), model_output["log_probs"].unbind(), strict=True):
            row = real.index(tuple(ids.tolist()))
            captured[row] = log_probs.detach()
            loss = loss + (log_probs * weights[row]).sum()
        return loss if train else loss * 0, {}

    model.train(train)  # as the worker's engine.train_mode() / eval_mode() set it
    output = engine.forward_backward_batch(data, loss_function, forward_only=not train)
    packed = torch.cat([captured[row] for row in range(len(real))])
    recorded = output["model_output"].get("routed_experts")
    if recorded is not None:
        recorded = _nested_in_batch_layout(recorded, batch["attention_mask"])
    result = {"log_probs": _response_log_probs(packed, batch), "recorded": recorded}
    return {**result, "gate_grads": gate_grads(model), "metrics": output.get("metrics")} if train else result


def _nested_in_batch_layout(nested: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    values = nested.values()
    out = torch.zeros(mask.numel(), *values.shape[1:], dtype=values.dtype)
    out[mask.flatten().nonzero().flatten()] = values
    return out.view(*mask.shape, *values.shape[1:])


def mismatch(chosen: torch.Tensor, record: torch.Tensor, mask: torch.Tensor) -> float:
    """The fraction of recorded real tokens routed to a different expert set in at least one layer."""
    recorded = mask.bool() & ~last_tokens(mask)
    same = chosen.sort(-1).values == record.long().sort(-1).values
    return float((~same.all(-1).all(-1))[recorded].float().mean())


def routes_of(model: nn.Module, batch: dict, **kwargs) -> tuple[dict, torch.Tensor]:
    """``verl_pass``'s result and the experts each real token went to, (bsz, seqlen, layers, top_k); with a
    recompute (activation checkpointing), its calls must route as the forward's did."""
    with chosen_experts(model) as chosen:
        result = verl_pass(model, batch, **kwargs)
    step = 2 if kwargs.get("train") and model.is_gradient_checkpointing else 1  # per micro-batch: forward, recompute
    per_layer = [torch.cat(layer[::step]) for layer in chosen]
    recomputed = [torch.cat(layer[step - 1 :: step]) for layer in chosen]
    result["recompute_same"] = all(torch.equal(a, b) for a, b in zip(per_layer, recomputed, strict=True))
    return result, in_batch_layout(per_layer, batch["attention_mask"])


def run_checks(kind: str = "moe") -> list[Check]:
    """R3 replays the rollout's routes exactly, and R2's update replays its record bit for bit."""
    label = "" if kind == "moe" else " (Qwen3.5-MoE)"
    model = build(kind)
    batch = batch_of()
    mask = batch["attention_mask"]
    record, rollout_lp = rollout_stand_in(model, batch)
    off, chosen_off = routes_of(model, batch)
    r3, chosen_r3 = routes_of(model, batch, mode="R3", record=record)
    replayed = mismatch(chosen_r3, record, mask)
    before = mismatch(chosen_off, record, mask)
    dlp = [float((r["log_probs"] - rollout_lp).abs().mean()) for r in (off, r3)]
    checks = [
        Check(
            f"R3 routes every recorded token as the rollout did{label}",
            replayed == 0.0 and before > 0,
            f"tokens routed unlike the rollout: {before:.0%} with replay off, {replayed:.0%} with R3; "
            f"mean |log p - rollout log p| {dlp[0]:.2e} off, {dlp[1]:.2e} R3",
        )
    ]
    r2 = verl_pass(model, batch, mode="R2")
    own = chosen_off.clamp(min=0).to(torch.int16)
    real = mask.bool().unsqueeze(-1).unsqueeze(-1)
    same_as_own = r2["recorded"] is not None and torch.equal(r2["recorded"] * real, own * real)
    checks.append(
        Check(f"R2 records the routes the model took{label}", same_as_own, "old-log-prob pass against a hook")
    )
    return checks


def checks_here() -> list[Check]:
    """In a process of its own: verl imported, the model hooks installed, verl's CPU stand-ins, one gloo rank."""
    import socket

    import torch.distributed as dist
    import verl  # noqa: F401

    from verl_qwen3vl_plugin.hooks import watch_group
    from verl_qwen3vl_plugin.registry import MODEL
    from verl_qwen3vl_plugin.selftest.ulysses import install_cpu_stand_ins

    watch_group(MODEL)
    install_cpu_stand_ins()
    with socket.socket() as sock:  # verl's actor and engine log and reduce over the default group
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from verl_qwen3vl_plugin.selftest.tiny_models import has_qwen3_5

    return run_checks() + (run_checks("qwen3_5_moe") if has_qwen3_5(verl=True) else [])


def run() -> list[Check]:
    from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay.spec import PATCH
    from verl_qwen3vl_plugin.registry import DISABLE_ENV, Verdict, decide_installed

    unrecognized = [d for d in (decide_installed(PATCH, t) for t in PATCH.targets) if d.verdict is Verdict.UNRECOGNIZED]
    if unrecognized:
        return [Check("routing replay through verl", False, f"unrecognized: {unrecognized[0].reason}")]
    return in_child(__name__, "routing replay through verl", drop=(DISABLE_ENV,))  # the patch, not the user's setup


if __name__ == "__main__":
    print(json.dumps([list(c) for c in checks_here()]))
