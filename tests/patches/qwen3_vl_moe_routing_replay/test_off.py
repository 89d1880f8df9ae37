"""Routing replay off: its wrappers of verl's methods hand the call to verl's method untouched, also for an engine or
actor built without a config, as verl's own unit tests build them (``test_fsdp_gradient_accumulation_sync_on_cpu``'s
``FSDPEngine`` at verl's v0.9.0 tag has no ``engine_config``)."""

from __future__ import annotations

import pytest

from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay import dp_actor, engine

MODULE = "verl.workers.engine.fsdp.transformer_impl"


class Bare:
    """An engine or actor with none of the attributes verl's constructor sets."""


Bare.__module__ = MODULE  # one of verl's own engine classes, as the wrapper tells them from VeOmni's


def upstream(self, data, *args, **kwargs):
    return ("upstream", self, data, args, kwargs)


upstream.__module__ = MODULE


@pytest.mark.parametrize(
    "wrap, args",
    [
        (engine.forward_backward_batch, ("batch", "loss_function", True)),
        (dp_actor.compute_log_prob, ("batch",)),
        (dp_actor.update_policy, ("batch",)),
    ],
    ids=["engine.forward_backward_batch", "actor.compute_log_prob", "actor.update_policy"],
)
def test_no_config_is_replay_off(wrap, args):
    owner = Bare()
    assert wrap(upstream)(owner, *args) == upstream(owner, *args)
