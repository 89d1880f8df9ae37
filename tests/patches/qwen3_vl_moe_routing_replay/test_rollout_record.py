"""R3's check of the rollout's record before replay, on records laid out as verl's agent loop writes vLLM's and
vllm-ascend's: one row per token the engine ran (every token of a sample but the last), from the sample's first real
token, zeros elsewhere; in every integer dtype they come in."""

from __future__ import annotations

import pytest
import torch

from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay import rollout_record
from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay.routes import ReplayError, has_route

LAYERS, TOP_K, EXPERTS = 3, 2, 8
PROMPT, RESPONSE = 6, 5
# (left padding, response tokens) per sample: prompts left-padded, responses right-padded
SAMPLES = [(0, 5), (2, 3), (1, 1)]


def batch(dtype=torch.int16):
    """(record, attention_mask, response_mask) as verl's trainer holds them."""
    bsz, seqlen = len(SAMPLES), PROMPT + RESPONSE
    attention = torch.zeros(bsz, seqlen, dtype=torch.long)
    record = torch.zeros(bsz, seqlen, LAYERS, TOP_K, dtype=torch.long)
    generator = torch.Generator().manual_seed(0)
    for i, (pad, response) in enumerate(SAMPLES):
        start, end = pad, PROMPT + response
        attention[i, start:end] = 1
        ran = end - start - 1  # vLLM: prompt + generated - 1 rows
        routes = torch.rand(ran, LAYERS, EXPERTS, generator=generator).argsort(-1)[..., :TOP_K]
        record[i, start : start + ran] = routes
    return record.to(dtype), attention, attention[:, PROMPT:].clone()


def check(record, attention, response_mask):
    loss = rollout_record.full_loss_mask(response_mask, attention.shape[1])
    cut = rollout_record.window_filled(attention)
    return rollout_record.check(has_route(record), attention, loss, TOP_K, cut)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.int16, torch.int32, torch.int64])
def test_a_record_as_the_agent_loop_writes_it_fits(dtype):
    """Missing last row, left padding, right padding, and each dtype: vLLM >= 0.22 (uint8 / uint16), 0.14 (int32),
    verl's ``as_dict`` (int64), verl main (int16)."""
    assert check(*batch(dtype)) == 0.0


def test_a_record_shifted_later_names_the_sample():
    record, attention, response = batch()
    record[1, 3:] = record[1, 2:-1].clone()  # sample 1's image took one more placeholder in the engine
    with pytest.raises(ReplayError, match=r"does not fit sample 1: it has a route on token 6 of its 7"):
        check(record, attention, response)


def test_a_record_shifted_earlier_names_the_sample():
    record, attention, response = batch()
    record[0] = torch.cat([record[0, 2:], torch.zeros_like(record[0, :2])])  # two placeholders fewer in the engine
    with pytest.raises(ReplayError, match=r"does not fit sample 0: the loss uses its token 9, .* end at token 7"):
        check(record, attention, response)


def test_a_route_in_the_padding_is_a_shift():
    record, attention, response = batch()
    record[2, 0] = torch.tensor([[1, 2]] * LAYERS)
    with pytest.raises(ReplayError, match="does not fit sample 2"):
        check(record, attention, response)


def test_tokens_after_the_final_generation_may_have_no_row():
    """Multi-turn: a tool's output after the last generation is outside the loss, and the engine never ran it."""
    record, attention, response = batch()
    record[0, 8:] = 0  # the final generation ended at token 8; tokens 9 and 10 are tool output
    response[0, 3:] = 0
    assert check(record, attention, response) == 0.0
    response[0, 4] = 1  # but a token the loss uses must have a row
    with pytest.raises(ReplayError, match="the loss uses its token 10"):
        check(record, attention, response)


def test_a_response_verl_cut_may_have_a_route_on_its_last_token():
    """A multi-turn response that ran past response_length: verl cuts it, and the record with it, so every token
    left has a row. Only a sample whose response fills the window can be cut."""
    record, attention, response = batch()
    record[0, PROMPT + RESPONSE - 1] = torch.tensor([[1, 2]] * LAYERS)  # sample 0's response fills its window
    assert check(record, attention, response) == 0.0


def test_a_cut_response_shifted_later_is_still_a_shift():
    """Where verl's cut lets the last token have a route, a record moved one row later shows as a first token with
    no route."""
    record, attention, response = batch()
    record[0] = torch.cat([torch.zeros_like(record[0, :1]), record[0, :-1]])
    record[0, -1] = torch.tensor([[1, 2]] * LAYERS)  # the row past the old end
    with pytest.raises(ReplayError, match="sample 0: it has no route on the sample's first token but one on its last"):
        check(record, attention, response)


def test_verl_filler_samples_are_not_counted():
    """verl 0.9 pads a batch to a multiple of the ranks with samples of real tokens, no record and no loss."""
    record, attention, response = batch()
    record[2], attention[2], response[2] = 0, 1, 0
    assert check(record, attention, response) == 0.0


def test_a_nested_response_loss_mask_sits_at_the_end_of_its_row():
    """verl 0.9's TransferQueue path: per sample, the loss mask of its response tokens."""
    lengths = torch.tensor([5, 3])
    loss = torch.nested.as_nested_tensor([torch.tensor([1, 0, 1]), torch.tensor([1])], layout=torch.jagged)
    assert rollout_record.nested_loss_mask(loss, lengths).tolist() == [[0, 0, 1, 0, 1], [0, 0, 1, 0, 0]]


def test_rows_without_route_are_a_fraction_and_past_the_limit_an_error(monkeypatch):
    record, attention, response = batch()
    ran = sum(PROMPT - pad + resp - 1 for pad, resp in SAMPLES)
    record[0, 2, 1] = 0  # one (token, layer) pair: vllm-ascend's skipped capture, say
    with pytest.raises(ReplayError, match=r"1\.6% of the .* above the 1\.0% limit"):
        check(record, attention, response)
    monkeypatch.setenv(rollout_record.MAX_FALLBACK_ENV, "0.05")
    assert check(record, attention, response) == pytest.approx(1 / (ran * LAYERS))
    record[:, :, 0] = 0  # a whole layer: vLLM's monolithic kernels skip the hook
    with pytest.raises(ReplayError, match=r"(?s)3[45]\.\d% of the .*vLLM #44116, #54730.*vllm-ascend #16314"):
        check(record, attention, response)
    monkeypatch.setenv(rollout_record.MAX_FALLBACK_ENV, "0.5")
    assert 0.34 < check(record, attention, response) < 0.36


def test_an_all_zero_record_is_counted_not_called_a_shift():
    record, attention, response = batch()
    with pytest.raises(ReplayError, match="100.0% of the"):
        check(torch.zeros_like(record), attention, response)


@pytest.mark.parametrize("value", ["1.5", "x", "-0.1"])
def test_a_bad_threshold_is_named(monkeypatch, value):
    monkeypatch.setenv(rollout_record.MAX_FALLBACK_ENV, value)
    with pytest.raises(ReplayError, match=rollout_record.MAX_FALLBACK_ENV):
        rollout_record.max_fallback()


def test_top_k_one_cannot_be_checked():
    record, attention, response = batch()
    routed, cut = torch.ones(*record.shape[:3], dtype=torch.bool), rollout_record.window_filled(attention)
    assert rollout_record.check(routed, attention, None, 1, cut) is None


def test_the_engine_layout_gives_the_same_flags():
    """verl >= 0.8: the record nested like input_ids (``left_right_2_no_padding``), flags put back padded."""
    record, attention, _ = batch()
    rows = [record[i][attention[i].bool()] for i in range(len(SAMPLES))]
    nested = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    assert torch.equal(rollout_record.padded_routed(nested, attention), has_route(record) & attention.bool()[..., None])
