"""Routing replay on verl 0.7's legacy FSDP actor (``DataParallelPPOActor``) and its worker.

The switch is verl's own ``actor_rollout_ref.actor.router_replay.mode`` (``RouterReplayConfig``, on every actor
config; verl's FSDP code never reads it). The reference policy has its own config (``ref.router_replay``, disabled by
default); a LoRA run's reference pass through the actor with its adapter off never replays.

- ``compute_log_prob``: R3 replays the batch's ``routed_experts`` (the rollout's); R2 records the actor's own routes,
  which the worker returns as ``routed_experts`` (as verl's Megatron worker does) and verl's trainer unions into the
  batch.
- ``update_policy``: R2 and R3 replay the batch's ``routed_experts``.

verl selects a fixed list of batch keys before it splits the batch, so the batch goes in as a ``DataProto`` whose
``select`` also keeps the record (and, when recording, each sample's index, which puts the routes of dynamic
batches back in batch order). Each micro-batch's record is laid out as ``_forward_micro_batch`` lays out its tokens:
the attention mask's real tokens through verl's ``unpad_input``, then Ulysses padding and slicing.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch

from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay import layout, rollout_record, routes
from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay import session as sessions
from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay.routes import KEY, RECORD, REPLAY, ReplayError

SAMPLE = "routing_replay_sample"  # each sample's index in the batch, while recording


_recorded: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # actor -> routes its last R2 pass recorded
_off: weakref.WeakSet = weakref.WeakSet()  # actors in a LoRA reference pass


def _keeping(data, keys: tuple[str, ...]):
    """``data`` (shallow: the same tensors) as a DataProto whose ``select`` also keeps those of ``keys`` it has."""
    cls = _keeping_class(type(data), keys)
    return cls(batch=data.batch, non_tensor_batch=data.non_tensor_batch, meta_info=data.meta_info)


@functools.cache
def _keeping_class(base: type, keys: tuple[str, ...]) -> type:
    class KeepingRoutes(base):
        def select(self, batch_keys=None, *args, **kwargs):
            if batch_keys is not None:
                batch_keys = [*batch_keys, *(k for k in keys if k in self.batch.keys() and k not in batch_keys)]
            return super().select(batch_keys, *args, **kwargs)

    return KeepingRoutes


def _session(actor, data, phase: str, mode: str) -> sessions.Session:
    """The batch's record checked (``session.checked``) on the actor's padded layout, and the call's session."""
    if getattr(actor, "use_prefix_grouper", False):
        raise ReplayError("routing replay does not support the prefix grouper (actor.use_prefix_grouper=False)")
    slots = routes.slots(actor.actor_module)
    record = data.batch.get(KEY, None) if data.batch is not None else None

    def r3():
        mask = data.batch["attention_mask"]
        loss_mask = rollout_record.full_loss_mask(data.batch.get("response_mask", None), mask.shape[1])
        return sessions.R3Record(routes.has_route(record), mask, loss_mask, rollout_record.window_filled(mask))

    def rows():
        return sessions.Rows(record, tuple(data.batch["input_ids"].shape))

    return sessions.Session(phase, slots, sessions.checked(phase, mode, slots, record is not None, rows, r3), len(data))


def compute_log_prob(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(self, data, *args, **kwargs):
        mode = None if self in _off else routes.mode_of(getattr(self, "config", None))
        if mode is None:
            return original(self, data, *args, **kwargs)
        phase = RECORD if mode == "R2" else REPLAY
        session = _session(self, data, phase, mode)
        if phase == RECORD:
            batch = data.batch.copy()
            batch[SAMPLE] = torch.arange(len(data), device=batch["input_ids"].device)
            data = type(data)(batch=batch, non_tensor_batch=data.non_tensor_batch, meta_info=data.meta_info)
        with sessions.running(self, session):
            result = original(self, _keeping(data, (KEY, SAMPLE)), *args, **kwargs)
        if phase == RECORD:
            _recorded[self] = session.assembled(data.batch["input_ids"].shape[1])
        return result

    return wrapper


def update_policy(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(self, data, *args, **kwargs):
        mode = routes.mode_of(getattr(self, "config", None))
        if mode is None:
            return original(self, data, *args, **kwargs)
        session = _session(self, data, REPLAY, mode)
        with sessions.running(self, session):
            metrics = original(self, _keeping(data, (KEY,)), *args, **kwargs)
        if isinstance(metrics, dict):  # verl appends per-mini-batch values to lists; these are one per step
            sessions.merge_metrics(metrics, session)
        return metrics

    return wrapper


def forward_micro_batch(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(self, micro_batch, *args, **kwargs):
        session = sessions.current(self)
        if session is None:
            return original(self, micro_batch, *args, **kwargs)
        mask = micro_batch["attention_mask"]
        if session.phase == REPLAY:
            rows, unpad = _decoder_order(self, micro_batch[KEY], mask)
            routes.begin(routes.Routes(session.slots, layout.decoder_rows(rows, *unpad)))
        else:
            routes.begin(routes.Routes(session.slots, None))
        out = original(self, micro_batch, *args, **kwargs)  # the routes stay current for this micro-batch's backward
        if session.phase == RECORD:
            session.parts.append((micro_batch[SAMPLE], _batch_order(self, routes.current().stacked(), mask)))
        return out

    return wrapper


def _decoder_order(actor, record: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """The record's rows as the decoder's tokens, before Ulysses padding and slicing: (rows, (pad, sp))."""
    sp = layout.sp_size(actor)
    if not actor.use_remove_padding:
        return record.flatten(0, 1), (0, 1)
    if not mask.any():  # verl runs sp dummy tokens
        rows = record.new_zeros(sp, *record.shape[2:])
    else:
        from verl.utils.attention_utils import unpad_input

        rows = unpad_input(record, mask)[0]
    return rows, (-rows.shape[0] % sp, sp)


def _batch_order(actor, local: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """This rank's recorded routes back in the micro-batch's (bsz, seqlen) layout, zeros where no token is. Every
    rank of the Ulysses group gathers, whatever its micro-batch holds."""
    bsz, seqlen = mask.shape
    if not actor.use_remove_padding:
        return local.reshape(bsz, seqlen, *local.shape[1:])
    from verl.utils.attention_utils import pad_input, unpad_input

    sp = layout.sp_size(actor)
    indices = unpad_input(mask.unsqueeze(-1), mask)[1]
    packed = indices.numel() if indices.numel() else sp  # verl runs sp dummy tokens for an empty micro-batch
    rows = layout.gathered_rows(local, -packed % sp, sp)
    if not indices.numel():
        return local.new_zeros(bsz, seqlen, *local.shape[1:])
    return pad_input(rows, indices, bsz, seqlen)


def take_recorded(actor) -> torch.Tensor | None:
    """The routes ``actor``'s last R2 ``compute_log_prob`` recorded, (bsz, seqlen, layers, top_k) in batch order
    with zeros where no token is; None when it recorded none. Taken once."""
    return _recorded.pop(actor, None)


def worker_compute_log_prob(original: Callable) -> Callable:
    """The worker's ``compute_log_prob``, returning the routes an R2 pass recorded as ``routed_experts``."""

    @functools.wraps(original)
    def compute_log_prob(self, data, *args, **kwargs):
        actor = self.actor
        lora_reference = bool(data.meta_info.get("is_lora", False))
        if lora_reference:
            _off.add(actor)
        try:
            output = original(self, data, *args, **kwargs)
        finally:
            _off.discard(actor)
        recorded = take_recorded(actor)
        if recorded is not None and not lora_reference:
            output.batch[KEY] = recorded
        return output

    return compute_log_prob
