"""The replay choice itself, on plain tensors: which experts a router takes, the weights and their gradient, rows
with no record, and the modes verl's configs can hold."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay import routes


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


def test_replay_tallies_what_it_did_once_per_layer_and_micro_batch():
    """The per-step figures verl logs: pairs replayed, and the share of them whose own top-k differs from the
    record. A checkpoint recompute (the same Routes routing again) counts once; a row with no record is not
    replayed."""
    router = Router()
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.03, 0.02]] * 4)  # own top-2: {0, 1} on every row
    record = torch.tensor([[[1, 0]], [[2, 3]], [[0, 0]], [[0, 1]]], dtype=torch.int16)  # row 1 differs, row 2 none
    routes.tally.reset()
    chosen = routes.Routes({router: 0}, record)
    chosen.choose(router, probs, 2)
    chosen.choose(router, probs, 2)  # the recompute in backward
    assert routes.step_metrics(0.25) == {
        "routing_replay/replayed_pairs": 3.0,
        "routing_replay/own_route_mismatch": 1 / 3,
        "routing_replay/fallback_fraction": 0.25,
    }
    routes.tally.reset()
    assert routes.tally.metrics() == {}


def test_a_repeated_id_is_no_route():
    """verl's zeros, and any id twice: a real top-k route never repeats an expert. Every integer dtype verl and
    vLLM produce."""
    rows = [[0, 0, 0], [3, 1, 3], [4, 1, 2], [0, 5, 1]]
    for dtype in (torch.uint8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64):
        assert routes.has_route(torch.tensor(rows, dtype=dtype)).tolist() == [False, False, True, True]


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


TOP_K_ROUTERS = {  # transformers 5's top-k routers: Qwen3-VL-MoE's and Qwen3.5-MoE's (transformers >= 5.2)
    "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe": "Qwen3VLMoeTextTopKRouter",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe": "Qwen3_5MoeTopKRouter",
}


@pytest.mark.parametrize("module, cls_name", TOP_K_ROUTERS.items(), ids=list(TOP_K_ROUTERS.values()))
def test_replaying_a_routers_own_routes_returns_what_upstream_returns_in_bf16(module, cls_name):
    """The replay forward casts as each release does (transformers 5.3 returns the fp32 probabilities and fp32
    weights, newer releases the logits and weights in their dtype), taking the first value from upstream's forward:
    replaying the router's own top-k is upstream's forward, bit for bit, dtypes included."""
    import importlib

    from verl_qwen3vl_plugin import environment, syntax
    from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay.routers import top_k_router_replay
    from verl_qwen3vl_plugin.selftest.tiny_models import QWEN3_5_MOE_TEXT

    tree = environment.tree(module)
    if tree is None or syntax.find_class(tree, cls_name) is None:
        pytest.skip(f"no {cls_name} in this transformers")
    config = type("Config", (), dict(QWEN3_5_MOE_TEXT, num_experts=8))
    router = getattr(importlib.import_module(module), cls_name)(config).bfloat16()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(generator=generator)
    hidden = torch.randn(2, 5, QWEN3_5_MOE_TEXT["hidden_size"], generator=generator).bfloat16()
    expected = type(router).forward(router, hidden)
    routes.begin(routes.Routes({router: 0}, expected[2].unsqueeze(1).to(torch.int16)))
    try:
        replayed = top_k_router_replay(router, hidden, type(router).forward)
    finally:
        routes.begin(None)
    for ours, theirs in zip(replayed, expected, strict=True):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


class Experts(nn.Module):
    top_k, num_experts = 2, 300  # more than 256: vLLM records them as uint16


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.int16, torch.int32, torch.int64], ids=str)
def test_every_integer_record_dtype_verl_and_vllm_produce_is_read(dtype):
    """uint8 / uint16 (vLLM >= 0.22, by expert count), int32 (vLLM 0.14), int64 (verl's as_dict), int16 (verl)."""
    highest = 255 if dtype == torch.uint8 else 299
    routes.check_record(torch.tensor([[[0, highest]], [[7, 3]]]).to(dtype), (2,), {Experts(): 0}, "the record")
    if dtype != torch.uint8:
        past = torch.tensor([[[1, 300]], [[7, 3]]]).to(dtype)
        with pytest.raises(routes.ReplayError, match=r"expert ids in \[1, 300\], but the model has 300 experts"):
            routes.check_record(past, (2,), {Experts(): 0}, "the record")
