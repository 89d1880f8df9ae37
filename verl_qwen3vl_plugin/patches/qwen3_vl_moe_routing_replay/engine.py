"""Routing replay on verl >= 0.8's FSDP engine (``FSDPEngine`` / ``FSDPEngineWithLMHead``), the path every verl
0.8 and 0.9 FSDP run trains through.

The switch is verl's own ``router_replay.mode`` on the engine config (``EngineConfig``, which the FSDP engine's
config inherits; verl reads it only for Megatron and VeOmni): ``actor_rollout_ref.actor.fsdp_config.router_replay
.mode``. Each engine reads its own, so the reference engine (its own config, disabled by default) never replays.

- ``forward_backward_batch``: a forward-only call is ``compute_log_prob``; R2 records there, and every other call
  replays. The batch's ``routed_experts`` is already nested like ``input_ids`` (verl's ``left_right_2_no_padding``).
- ``prepare_model_inputs``: each micro-batch's record padded as verl pads the packed tokens (``pad_size``: Ulysses
  and static padding) and sliced to this rank's Ulysses chunk.
- ``prepare_model_outputs``: R2's recorded routes gathered back like log-probs, returned nested as
  ``routed_experts``; verl puts them back in batch order after dynamic batching, returns them from
  ``compute_log_prob`` and its trainer unions them into the batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay import layout, rollout_record, routes
from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay import session as sessions
from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay.routes import KEY, RECORD, REPLAY, ReplayError


def _check(data, phase: str, mode: str, slots: dict) -> float | None:
    """The record's checks (``session.checked``), on the engine's nested layout."""
    record, ids = data.get(KEY, None), data["input_ids"]

    def rows():
        if not (record.is_nested and ids.is_nested):
            raise ReplayError(f"the batch's {KEY} and input_ids must be nested (verl's no-padding layout)")
        if not torch.equal(record.offsets().cpu(), ids.offsets().cpu()):
            raise ReplayError(f"the batch's {KEY} is not aligned with input_ids (different sequence lengths)")
        return sessions.Rows(record.values(), (ids.values().shape[0],))

    def r3():
        lengths = ids.offsets().diff()
        attention_mask = data.get("attention_mask", None)
        if attention_mask is not None and not attention_mask.is_nested and attention_mask.shape[0] == len(lengths):
            # verl's trainer keeps the padded attention and response masks beside the nested tensors
            response_mask = data.get("response_mask", None)
            padded = response_mask if response_mask is not None and not response_mask.is_nested else None
            loss_mask = rollout_record.full_loss_mask(padded, attention_mask.shape[1])
            last_may_route = rollout_record.window_filled(attention_mask)
        else:
            # verl 0.9's TransferQueue path: each sample's tokens are its nested row, its loss mask its response's;
            # where verl cut a response is unknown there, so a route on the last token is allowed
            attention_mask = torch.arange(int(lengths.max()), device=lengths.device) < lengths[:, None]
            loss = data.get("loss_mask", None)
            loss_mask = rollout_record.nested_loss_mask(loss, lengths) if loss is not None and loss.is_nested else None
            last_may_route = torch.ones(len(lengths), dtype=torch.bool, device=lengths.device)
        return sessions.R3Record(
            rollout_record.padded_routed(record, attention_mask), attention_mask, loss_mask, last_may_route
        )

    return sessions.checked(phase, mode, slots, record is not None, rows, r3)


def forward_backward_batch(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(self, data, loss_function, forward_only=False):
        # verl's own FSDP engines only: VeOmni's subclasses replay by themselves. An engine built without a config
        # (verl's own unit tests build them so) has replay off: nothing is read that verl's method does not read.
        own = type(self).__module__ == original.__module__
        mode = routes.mode_of(getattr(self, "engine_config", None)) if own else None
        if mode is None:
            return original(self, data, loss_function, forward_only)
        phase = RECORD if mode == "R2" and forward_only else REPLAY
        slots = routes.slots(self.module)
        session = sessions.Session(phase, slots, _check(data, phase, mode, slots))
        with sessions.running(self, session):
            output = original(self, data, loss_function, forward_only)
        if phase == REPLAY and not forward_only and isinstance(output, dict) and "metrics" in output:
            sessions.merge_metrics(output["metrics"], session)  # logged with the update's, per step
        return output

    return wrapper


def prepare_model_inputs(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(self, micro_batch):
        model_inputs, output_args = original(self, micro_batch)
        session = sessions.current(self)
        if session is not None:
            from verl.utils import tensordict_utils as tu

            if not tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True):
                raise ReplayError("routing replay on verl's FSDP engine needs actor.use_remove_padding=True")
            targets = None
            if session.phase == REPLAY:
                targets = layout.decoder_rows(
                    micro_batch[KEY].values(), output_args.get("pad_size", 0), layout.sp_size(self)
                )
            # current until the next micro-batch: its backward reads it
            routes.begin(routes.Routes(session.slots, targets))
        return model_inputs, output_args

    return wrapper


def prepare_model_outputs(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(self, output, output_args, micro_batch, *args, **kwargs):
        model_output = original(self, output, output_args, micro_batch, *args, **kwargs)
        session = sessions.current(self)
        if session is not None and session.phase == RECORD:
            ids = micro_batch["input_ids"]
            rows = layout.gathered_rows(
                routes.current().stacked(), output_args.get("pad_size", 0), layout.sp_size(self)
            )
            model_output[KEY] = torch.nested.nested_tensor_from_jagged(rows, offsets=ids.offsets())
        return model_output

    return wrapper
