"""verl's ``actor.freeze_vision_tower`` carried from the actor's config to its FSDP engine, which freezes the vision
tower before wrapping it: no gradient, no optimizer state, no autograd graph in the tower's forward.

When it applies, and when it can be removed: the ``freeze_vision_tower`` spec.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Collection

import torch

logger = logging.getLogger("verl_qwen3vl_plugin")

# Set on the actor's engine config (its ``fsdp_config``, which verl hands to the engine as ``engine_config``): the one
# channel from the actor's settings to the engine, which is built from the engine config alone.
REQUEST = "_verl_qwen3vl_freeze_vision_tower"
# Set on a vision tower this plugin froze: FSDP1's wrap policy makes it a unit of its own.
FROZEN = "_verl_qwen3vl_frozen_tower"
FSDP_STRATEGIES = ("fsdp", "fsdp2")


def carry_request(post_init: Callable) -> Callable:
    @functools.wraps(post_init)
    def __post_init__(self) -> None:
        """verl's ``ActorConfig.__post_init__``; then, with ``freeze_vision_tower`` on, the request handed to the
        FSDP engine config, or a WARNING where no engine the plugin covers will read it."""
        post_init(self)
        if not getattr(self, "freeze_vision_tower", False):
            return
        engine = getattr(self, "fsdp_config", None)
        if self.strategy in FSDP_STRATEGIES and dataclasses.is_dataclass(engine):
            object.__setattr__(engine, REQUEST, True)  # verl's configs refuse new values only for their fields
        elif self.strategy not in FSDP_STRATEGIES:
            logger.warning(
                "verl-qwen3vl-plugin: actor.freeze_vision_tower is set, but strategy %r does not read it and the "
                "plugin covers only verl's FSDP engine (fsdp, fsdp2): the vision tower trains",
                self.strategy,
            )

    return __post_init__


def freeze_towers(module: torch.nn.Module, towers: Collection[str]) -> list[torch.nn.Module]:
    """Freeze every vision tower of a class named in ``towers`` inside ``module`` (a PEFT model too), with whatever
    LoRA adapters it holds, and mark it for the wrap policy. A model without one gets a WARNING: its tower, if it
    has one, is not one the plugin knows, and trains."""
    found = [m for m in module.modules() if type(m).__name__ in towers]
    if not found:
        logger.warning(
            "verl-qwen3vl-plugin: actor.freeze_vision_tower is set, but %s holds no %s: the plugin freezes only "
            "those towers, so this model's vision tower (if any) trains",
            type(module).__name__,
            " / ".join(sorted(towers)),
        )
    for tower in found:
        adapters = sum(p.numel() for n, p in tower.named_parameters() if p.requires_grad and "lora_" in n)
        tower.requires_grad_(False)
        setattr(tower, FROZEN, True)
        logger.info(
            "verl-qwen3vl-plugin: froze %s (%d parameters) for actor.freeze_vision_tower",
            type(tower).__name__,
            sum(p.numel() for p in tower.parameters()),
        )
        if adapters:
            logger.warning(
                "verl-qwen3vl-plugin: actor.freeze_vision_tower froze %d LoRA adapter parameters in %s: they stay "
                "at their initial values; leave the tower out of lora target_modules to save their cost",
                adapters,
                type(tower).__name__,
            )
    return found


def freeze_before_wrapping(build_fsdp_module: Callable, towers: Collection[str]) -> Callable:
    @functools.wraps(build_fsdp_module)
    def _build_fsdp_module(self, module):
        """verl's ``FSDPEngine._build_fsdp_module``, given a module whose vision tower is frozen when the actor asked
        for it: frozen before FSDP wraps it, and before verl builds the optimizer from the wrapped parameters."""
        if getattr(self.engine_config, REQUEST, False) and not self.engine_config.forward_only:
            freeze_towers(module, towers)
        return build_fsdp_module(self, module)

    return _build_fsdp_module


def tower_unit(get_policy: Callable) -> Callable:
    @functools.wraps(get_policy)
    def get_fsdp_wrap_policy(*args, **kwargs):
        """verl's wrap policy, plus a unit of its own for a tower the plugin froze. FSDP1 without
        ``use_orig_params`` refuses a flat parameter that mixes frozen and trainable ones, and with it would still
        build the frozen ones' graph: the tower's own unit holds only frozen parameters."""
        from torch.distributed.fsdp.wrap import _or_policy, lambda_auto_wrap_policy

        policy = get_policy(*args, **kwargs)
        module = kwargs["module"] if "module" in kwargs else args[0]
        if not any(getattr(m, FROZEN, False) for m in module.modules()):
            return policy
        own = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: getattr(m, FROZEN, False))
        return own if policy is None else functools.partial(_or_policy, policies=[policy, own])

    return get_fsdp_wrap_policy
