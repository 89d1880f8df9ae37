"""One routing-replay pass of a verl call, whichever verl path runs it (verl 0.7's legacy actor, the FSDP engine of
verl >= 0.8): the check of the batch's record, the session its micro-batches read, and the per-step metrics merged
into verl's.

A verl call opens one ``Session`` for its owner (the actor or the engine) with ``running``; each micro-batch then finds
it with ``current(owner)`` and makes its routes current (``routes.begin``). The session ends with the call, and so do
its routes, whatever the call raised.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay import rollout_record, routes
from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay.routes import KEY


class Rows(NamedTuple):
    """The record's token rows, once the path checked its layout, and the shape they must have."""

    record: torch.Tensor
    shape: tuple[int, ...]


class R3Record(NamedTuple):
    """R3's view of the rollout's record, padded as verl's actor pads its batch, for the fit check."""

    routed: torch.Tensor  # which (token, layer) pairs have a route
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor | None
    last_may_route: torch.Tensor  # which samples may carry a route on their last token


class Session:
    """What one verl call replays or records: its phase, the model's MoE slots, R3's fallback share, and, when the
    legacy actor records, each micro-batch's (sample indices, routes)."""

    def __init__(self, phase: str, slots: dict, fallback: float | None = None, samples: int = 0) -> None:
        self.phase, self.slots, self.fallback, self.samples = phase, slots, fallback, samples
        self.parts: list[tuple[torch.Tensor, torch.Tensor]] = []

    def assembled(self, seqlen: int) -> torch.Tensor:
        """The recorded parts as (samples, seqlen, layers, top_k) in batch order, zeros where no token is."""
        layers, k = len(self.slots), next(iter(self.slots)).top_k
        out = torch.zeros(self.samples, seqlen, layers, k, dtype=routes.ROUTE_DTYPE)
        for index, part in self.parts:
            out[index.cpu()] = part.cpu()
        return out


def checked(
    phase: str, mode: str, slots: dict, present: bool, rows: Callable[[], Rows], r3: Callable[[], R3Record]
) -> float | None:
    """The batch's record checked as both paths check it: ``present`` where the phase needs it, then its layout and
    token rows (``rows``: the rows and the shape they must have, after the path's own layout checks), every MoE
    layer's top-k, and for R3 its fit to each sample (``r3``). Returns R3's fallback share
    (``rollout_record.check``), None otherwise."""
    routes.check_present(phase, mode, present)
    if not present:
        return None
    found = rows()
    routes.check_record(found.record, found.shape, slots, f"the batch's {KEY}")
    if mode != "R3":
        return None
    view = r3()
    top_k = next(iter(slots)).top_k
    return rollout_record.check(view.routed, view.attention_mask, view.loss_mask, top_k, view.last_may_route)


_sessions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # owner -> its running Session


@contextlib.contextmanager
def running(owner: object, session: Session) -> Iterator[Session]:
    """``session`` is ``owner``'s for the call: the replay tally starts at zero, and the session and its routes end
    with the call."""
    _sessions[owner] = session
    routes.tally.reset()
    try:
        yield session
    finally:
        _sessions.pop(owner, None)
        routes.begin(None)


def current(owner: object) -> Session | None:
    return _sessions.get(owner)


def merge_metrics(metrics: dict, session: Session) -> None:
    """The step's replay figures into verl's metrics, one value per list as verl gathers its own."""
    metrics.update({key: [value] for key, value in routes.step_metrics(session.fallback).items()})
