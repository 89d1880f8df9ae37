"""The replay choice itself, on plain tensors: which experts a router takes, the weights and their gradient, rows
with no record, and the modes verl's configs can hold."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from verl_qwen3vl_plugin.replacements.routing_replay import routes


class Router(nn.Module):
    top_k, num_experts = 2, 6


def test_replayed_ids_weights_at_them_and_rows_without_record_keep_their_own():
    router = Router()
    logits = torch.randn(4, 6, generator=torch.Generator().manual_seed(0), requires_grad=True)
    probs = logits.softmax(-1)
    record = torch.tensor([[[5, 0]], [[1, 2]], [[0, 0]], [[3, 4]]], dtype=torch.int16)  # row 2: no record
    chosen = routes.Routes({router: 0}, record)
    weights, ids = chosen.choose(router, probs, 2)
    own = probs.topk(2, dim=-1).indices
    assert torch.equal(ids[[0, 1, 3]], record[[0, 1, 3], 0].long()) and torch.equal(ids[2], own[2])
    assert torch.equal(weights, probs.gather(-1, ids))
    weights.sum().backward()
    assert logits.grad.abs().sum() > 0


def test_recording_keeps_the_own_top_k_and_stacks_per_layer():
    first, second = Router(), Router()
    probs = torch.rand(3, 6, generator=torch.Generator().manual_seed(1))
    recording = routes.Routes({first: 0, second: 1}, None)
    for router in (first, second):
        assert torch.equal(recording.choose(router, probs, 2)[1], probs.topk(2, dim=-1).indices)
    stacked = recording.stacked()
    assert stacked.shape == (3, 2, 2) and stacked.dtype == torch.int16


def test_a_layer_that_did_not_route_is_an_error():
    first = Router()
    recording = routes.Routes({first: 0, Router(): 1}, None)
    recording.choose(first, torch.rand(3, 6), 2)
    with pytest.raises(routes.ReplayError, match=r"MoE layers \[1\] did not route"):
        recording.stacked()


def test_rows_that_do_not_match_the_tokens_are_an_error():
    router = Router()
    chosen = routes.Routes({router: 0}, torch.zeros(5, 1, 2, dtype=torch.int16))
    with pytest.raises(routes.ReplayError, match="5 rows for this micro-batch, but MoE layer 0 routes 4 tokens"):
        chosen.choose(router, torch.rand(4, 6), 2)


@pytest.mark.parametrize(
    "config, mode",
    [
        ({"router_replay": {"mode": "R3"}}, "R3"),  # the plain dict hydra leaves on the FSDP engine's config
        (OmegaConf.create({"router_replay": {"mode": "R2"}}), "R2"),
        ({"router_replay": {"mode": "disabled"}}, None),
        ({}, None),
    ],
)
def test_mode_of_every_config_form(config, mode):
    assert routes.mode_of(config) == mode


def test_an_unknown_mode_is_an_error():
    with pytest.raises(routes.ReplayError, match="router_replay.mode='R4'"):
        routes.mode_of({"router_replay": {"mode": "R4"}})
