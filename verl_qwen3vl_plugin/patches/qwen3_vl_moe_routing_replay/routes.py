"""The routes one micro-batch replays or records, one slot per MoE layer, and the top-k choice of every patched
router.

One ``Routes`` is current per process: verl runs a micro-batch's forward, then its backward (where activation
checkpointing recomputes the forward), before the next micro-batch's forward. So the routes stay current until the
next micro-batch replaces them or the verl call that set them ends. A router finds its slot by its own identity
(``slots``: router module -> MoE layer ordinal), so a recompute reads the slot its forward read.

A row with no record (left and right padding, Ulysses padding, the last response token, which the rollout engine
never ran, and a pair the engine failed to record) is zeros in verl's record: repeated expert ids, which no real route
of top_k > 1 has. Such a pair is routed by the router's own top-k, never sent to expert 0.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch
from torch import nn

from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay.settings import KEY, ROLLOUT_SETTING

RECORD, REPLAY = "record", "replay"
MODES = ("R2", "R3")
ROUTE_DTYPE = torch.int16  # as verl 0.9.1's agent loop stores the rollout's record
_REPLAY_AWARE = "_verl_qwen3vl_plugin_replay_aware"


class ReplayError(ValueError):
    """A routing-replay setting, model or record that replay cannot honour: never a silent fallback."""


class Routes:
    """One micro-batch's routes: ``targets`` (tokens, layers, top_k) to replay, or None to record."""

    def __init__(self, slots: Mapping[nn.Module, int], targets: torch.Tensor | None) -> None:
        self.slots = slots
        self.targets = targets
        self.recorded: list[torch.Tensor | None] = [None] * (max(slots.values(), default=-1) + 1)
        self._on_device: torch.Tensor | None = None
        self._tallied: set[int] = set()  # slots counted in this micro-batch (a checkpoint recompute routes again)

    def choose(self, router: nn.Module, probs: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k probabilities, expert ids) for ``router``'s tokens: its own top-k, recorded; or the replayed ids
        with the probabilities gathered at them, so the gate still gets its gradient."""
        slot = self.slots[router]
        weights, indices = torch.topk(probs, top_k, dim=-1)
        if self.targets is None:
            self.recorded[slot] = indices.detach()
            return weights, indices
        if self.targets.shape[0] != probs.shape[0]:
            raise ReplayError(
                f"the routing record has {self.targets.shape[0]} rows for this micro-batch, but MoE layer {slot} "
                f"routes {probs.shape[0]} tokens: the record is not aligned with the batch"
            )
        if self._on_device is None or self._on_device.device != probs.device:
            self._on_device = self.targets.to(probs.device, torch.long)
        target = self._on_device[:, slot]
        recorded = has_route(target)
        target = torch.where(recorded.unsqueeze(-1), target, indices)
        if slot not in self._tallied:
            self._tallied.add(slot)
            differs = (indices.sort(-1).values != target.sort(-1).values).any(-1) & recorded
            tally.add(recorded.sum(), differs.sum())
        return probs.gather(-1, target), target

    def stacked(self) -> torch.Tensor:
        """The recorded routes, (tokens, layers, top_k) in verl's record dtype."""
        missing = [slot for slot, ids in enumerate(self.recorded) if ids is None]
        if missing:
            raise ReplayError(f"MoE layers {missing} did not route in the recording forward")
        return torch.stack(self.recorded, dim=1).to(ROUTE_DTYPE)


class Tally:
    """What replay did over one verl call, per (token, MoE layer) pair: the per-step figures verl logs (the engine
    adds them to its metrics). Kept on the device until read: no host sync per layer."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.replayed: torch.Tensor | int = 0
        self.own_differs: torch.Tensor | int = 0

    def add(self, replayed: torch.Tensor, own_differs: torch.Tensor) -> None:
        self.replayed = self.replayed + replayed
        self.own_differs = self.own_differs + own_differs

    def metrics(self) -> dict[str, float]:
        """``replayed_pairs``: (token, layer) pairs routed by the record; ``own_route_mismatch``: of those, the ones
        whose own top-k differs from the record: what replay changed. The pairs with no record are the record
        check's ``fallback_fraction`` (``rollout_record``)."""
        replayed = int(self.replayed)
        if not replayed:
            return {}
        return {
            "routing_replay/replayed_pairs": float(replayed),
            "routing_replay/own_route_mismatch": int(self.own_differs) / replayed,
        }


tally = Tally()


def step_metrics(fallback: float | None) -> dict[str, float]:
    """The figures a replaying step adds to verl's metrics: the tally's, and R3's record check's
    ``fallback_fraction`` (of the (token, layer) pairs the rollout ran, those its record has no route for)."""
    metrics = tally.metrics()
    if fallback is not None:
        metrics["routing_replay/fallback_fraction"] = fallback
    return metrics


_current: Routes | None = None
_slots: weakref.WeakKeyDictionary[nn.Module, dict[nn.Module, int]] = weakref.WeakKeyDictionary()


def has_route(ids: torch.Tensor) -> torch.Tensor:
    """(..., top_k) expert ids -> (...) True where they are a route: k distinct ids. verl's zeros (and any repeat)
    are no route; with top_k 1 every row is one. Pairwise compares, not a sort: a step's record can be gigabytes."""
    k = ids.shape[-1]
    route = torch.ones(ids.shape[:-1], dtype=torch.bool, device=ids.device)
    ids = widened(ids)
    for i in range(k - 1):
        route &= ~(ids[..., i : i + 1] == ids[..., i + 1 :]).any(-1)
    return route


def widened(ids: torch.Tensor) -> torch.Tensor:
    """``ids`` in a dtype torch compares and reduces: it has no min / max / eq for uint16 and uint32 on every
    backend (vLLM's record of more than 256 experts)."""
    return ids.long() if ids.dtype in (torch.uint16, torch.uint32, torch.uint64) else ids


def begin(routes: Routes | None) -> None:
    global _current
    _current = routes


def current() -> Routes | None:
    return _current


def top_k(router: nn.Module, probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(probs, k, dim=-1)``, unless replay is on for ``router``'s model."""
    routes = _current
    if routes is None or router not in routes.slots:
        return torch.topk(probs, k, dim=-1)
    return routes.choose(router, probs, k)


def replaying(router: nn.Module) -> bool:
    """Whether a micro-batch's routes cover ``router`` now (the patched forwards call upstream's otherwise)."""
    return _current is not None and router in _current.slots


def mark(forward):
    """Mark a forward as one that routes through ``top_k``, so ``slots`` can tell it from one set over it."""
    setattr(forward, _REPLAY_AWARE, True)
    return forward


_router_classes: tuple[type, ...] = ()  # the classes the patch made replay-aware, in this process


def register_router(cls: type) -> None:
    global _router_classes
    if cls not in _router_classes:
        _router_classes = (*_router_classes, cls)


def registered(cls: type) -> bool:
    """Whether ``cls`` is a router class made replay-aware in this process."""
    return cls in _router_classes


def slots(model: nn.Module) -> dict[nn.Module, int]:
    """The model's routers, in layer order, each with its MoE layer ordinal; cached per model. Only MoE layers have
    a router, so the ordinal counts those (every decoder layer of Qwen3-VL-MoE and Qwen3.5-MoE, gated delta-net or
    full attention alike).

    A router is a module whose forward the plugin made replay-aware (``mark``). A router class whose forward was
    replaced after the plugin patched it (verl's ``apply_monkey_patch`` on transformers <= 4.57.3 sets its own MoE
    block forward) would ignore the record: that is an error, as is a model with no router at all.
    """
    found = _slots.get(model)
    if found is not None:
        return found
    routers = [m for m in model.modules() if isinstance(m, _router_classes)]
    replaced = sorted({type(m).__qualname__ for m in routers if not getattr(type(m).forward, _REPLAY_AWARE, False)})
    if replaced:
        raise ReplayError(
            f"routing replay is on, but {', '.join(replaced)}.forward was replaced after the plugin patched it, so "
            "it would ignore the record"
        )
    if not routers:
        raise ReplayError(
            f"routing replay is on, but {type(model).__name__} has no MoE router the plugin patched "
            "(Qwen3-VL-MoE's sparse block or top-k router, Qwen3.5-MoE's top-k router, or verl's Ascend sparse block); "
            "see `verl-qwen3vl-plugin doctor`"
        )
    found = {router: i for i, router in enumerate(routers)}
    _slots[model] = found
    return found


def mode_of(config) -> str | None:
    """``router_replay.mode`` of a verl actor or engine config (a dataclass, an OmegaConf node, or the plain dict
    hydra leaves where the FSDP engine's YAML does not declare the group): "R2", "R3", or None when disabled."""
    replay = _field(config, "router_replay")
    mode = _field(replay, "mode") if replay is not None else None
    if mode in (None, "disabled"):
        return None
    if mode not in MODES:
        raise ReplayError(f"router_replay.mode={mode!r}: use 'disabled', 'R2' or 'R3'")
    return mode


def _field(config, name: str):
    if isinstance(config, Mapping):
        return config.get(name)
    try:
        return config.get(name)  # OmegaConf DictConfig and verl's BaseConfig
    except AttributeError:
        return getattr(config, name, None)


def check_present(phase: str, mode: str, present: bool) -> None:
    """The batch holds a record exactly where the phase needs one: replay reads it; R2's recording pass must not
    find the rollout's (R2 and R3 at once)."""
    if phase == RECORD and present:
        raise ReplayError(
            f"router_replay.mode=R2 records the actor's own routes, but the batch already holds the rollout's {KEY} "
            f"({ROLLOUT_SETTING}): R2 and R3 cannot both be on; set router_replay.mode=R3 to replay the rollout's"
        )
    if phase == REPLAY and not present and mode == "R3":
        raise ReplayError(
            f"router_replay.mode=R3 replays the rollout's routes, but the batch has no {KEY}: turn on "
            f"{ROLLOUT_SETTING} (vLLM returns the routes)"
        )
    if phase == REPLAY and not present:
        raise ReplayError(
            f"router_replay.mode=R2 replays the routes the old-log-prob pass recorded, but the batch has no {KEY}: "
            "the update needs that pass (it is skipped in rollout_correction.bypass_mode)"
        )


def check_record(record: torch.Tensor, tokens: tuple[int, ...], routers: Mapping[nn.Module, int], what: str) -> None:
    """``record`` ``tokens + (layers, top_k)`` integers, every id an expert of the model; else a ReplayError that
    names what does not match."""
    layers = len(routers)
    router = next(iter(routers))
    k, experts = router.top_k, router.num_experts
    if record.is_floating_point() or record.is_complex() or record.dtype == torch.bool:
        raise ReplayError(f"{what} has dtype {record.dtype}: expert ids must be integers")
    if tuple(record.shape) != (*tokens, layers, k):
        raise ReplayError(
            f"{what} has shape {tuple(record.shape)}, but the batch and model need {(*tokens, layers, k)} "
            f"(tokens, {layers} MoE layers, top_k {k})"
        )
    if record.numel():
        ids = widened(record)
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= experts:
            raise ReplayError(f"{what} holds expert ids in [{low}, {high}], but the model has {experts} experts")
