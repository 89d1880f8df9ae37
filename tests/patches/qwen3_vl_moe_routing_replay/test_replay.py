"""Routing replay (R2 / R3) through verl's own actor (verl 0.7.x) or FSDP engine (verl >= 0.8), on a tiny
Qwen3-VL-MoE with images and a perturbed-weights rollout stand-in (``routing_replay.py``, beside this file); the
single-process checks also on a tiny hybrid Qwen3.5-MoE (verl >= 0.8, transformers >= 5.2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import QWEN3_5_TRAINED, VERL, child_json

HERE = Path(__file__).parent  # this patch's child scripts

DISABLED = {"VERL_QWEN3VL_PLUGIN_DISABLE": "qwen3_vl_moe_routing_replay"}
# The two verl code paths replay acts on, each on its newest stack (CI time): 0.7's legacy actor, the FSDP engine.
both_paths = pytest.mark.skipif(
    VERL.release not in ((0, 7, 1), (0, 9, 1)), reason="run on verl 0.7.1 (legacy actor) and 0.9.1 (FSDP engine)"
)


@pytest.fixture(scope="module", params=["moe", *(["qwen3_5_moe"] if QWEN3_5_TRAINED else [])])
def single(request):
    return {"kind": request.param, **child_json(HERE / "routing_replay.py", "single", request.param)}


@pytest.fixture(scope="module")
def control():
    return child_json(HERE / "routing_replay.py", "control", env=DISABLED)


def test_r3_routes_every_recorded_token_as_the_rollout_did(single):
    assert single["r3_equals_record"] and single["r3_train_equals_record"]
    assert single["mismatch_off"] > 0 and single["mismatch_r3"] == 0


def test_r3_lowers_the_log_prob_mismatch_against_the_rollout(single):
    assert single["dlogp_mean_r3"] < single["dlogp_mean_off"]
    assert single["dlogp_max_r3"] < single["dlogp_max_off"]


def test_r2_update_replays_its_record_bit_for_bit(single):
    assert single["r2_records_own"] and single["r2_record_dtype"] == "torch.int16"
    assert single["r2_update_routes_recorded"] and single["r2_update_equals_record_pass"]


@pytest.mark.skipif(VERL.release >= (0, 8), reason="verl 0.7's worker; on >= 0.8 the engine returns the routes")
def test_r2_worker_returns_the_record_as_routed_experts(single):
    assert single["worker_r2_returns_record"] is True


def test_gate_gradient_under_replay_is_the_routing_gradient(single):
    """Replaying the model's own routes: the gate's gradient is upstream's own, and not zero."""
    assert single["gate_grad_nonzero"] and single["gate_grad_max_rel_diff"] < 1e-6


def test_checkpoint_recompute_replays_the_same_routes(single):
    assert single["checkpointing_recompute_same"] and single["checkpointing_routes_same"]
    assert single["checkpointing_log_prob_diff"] == 0 and single["checkpointing_grad_diff"] < 1e-6


def test_dynamic_batches_keep_routes_in_batch_order(single):
    """Qwen3.5-MoE too: its gated delta-net layers keep packed samples apart (``qwen3_5_packed_delta_net``), so
    dynamic batching's regrouping leaves the log-probs as static batching's."""
    assert single["dynamic_r2_record_same"] and single["dynamic_r3_log_prob_diff"] < 1e-5


CASTS_RECORD = (0, 8) <= VERL.release < (0, 9, 1)  # verl's left_right_2_no_padding casts it to uint8 first


@pytest.mark.parametrize(
    "case, message",
    [
        ("r3_without_record", "enable_rollout_routing_replay=True"),
        ("r2_with_record", "R2 and R3 cannot both be on"),
        ("layers", "2 MoE layers"),
        ("top_k", "top_k 2"),
        # verl >= 0.8: the trainer's own left_right_2_no_padding fails first, indexing the short record
        (
            "length",
            "(4, 18, 2, 2), but the batch and model need (4, 19, 2, 2)" if VERL.release < (0, 8) else "out of bounds",
        ),
        ("expert_id", "expert ids in [0, 8], but the model has 8 experts"),
        ("float_record", "expert ids must be integers"),
        ("mode", "R4"),
        ("shifted_later", "does not fit sample 0: it has no route on the sample's first token but one on its last"),
        # verl 0.7's padded batch: rows moved into the left padding; verl >= 0.8 drops those, the tail is short
        ("shifted_earlier", "2 rows before its first token" if VERL.release < (0, 8) else "the loss uses its token"),
        ("zero_layer", "50.0% of the (token, MoE layer) pairs the rollout ran have no route"),
    ],
)
def test_bad_input_raises_its_error(single, case, message):
    if case == "float_record" and CASTS_RECORD:
        pytest.skip("this verl's trainer casts the record to uint8 before the engine sees it")
    assert single["errors"][case] is not None and message in single["errors"][case], single["errors"][case]


def test_every_integer_dtype_of_the_record_replays(single):
    """uint8 (vLLM >= 0.22), int32 (vLLM 0.14), int64 (verl's ``as_dict``), through verl's own path."""
    assert all(single["dtypes_replayed"].values()), single["dtypes_replayed"]


def test_rows_without_route_fall_back_to_the_model_and_are_counted(single):
    """A record missing rows inside its samples (an engine that skipped its router hook): those tokens take the
    model's own routes, and the update's metrics give their share of what the rollout ran."""
    fallback = single["fallback"]
    assert fallback["missing_rows_routed_by_model"]
    assert fallback["metric"] == pytest.approx(fallback["expected"]) and fallback["metric"] > 0.1


@both_paths
def test_replay_off_is_bit_identical_to_the_plugin_without_the_patch(single, control):
    if single["kind"] != "moe":
        pytest.skip("the control runs Qwen3-VL-MoE")
    assert single["off"] == control["off"]


@both_paths
def test_without_the_patch_r3_is_ignored_the_control(control):
    assert not control["r3_equals_record"]


@both_paths
def test_two_ranks_fsdp2_and_ulysses():
    """FSDP2 over two gloo ranks holding different data: each replays its own record, and nothing hangs; SP = 2
    (the world as the Ulysses group) against SP = 1 with replay, images in the batch."""
    ranks = child_json(HERE / "routing_replay.py", "ranks")
    for result in ranks:
        assert "error" not in result, result.get("error")
        assert result["fsdp2_r3_equals_record"] and result["fsdp2_r3_train_equals_record"]
        assert result["sp_log_prob_diff"] < 1e-5 and result["sp_gate_grad_rel_diff"] < 1e-5
        assert result["sp_r2_record_same"]
