"""``qwen3_vl_nested_position_ids`` against verl's own ``maybe_fix_3d_position_ids`` and verl's own per-sample
split, on every stack: samples packed as TransferQueue packs them (``torch.nested.as_nested_tensor``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from verl.utils import tensordict_utils

from tests.helpers import VERL, child_json, decide_text
from verl_qwen3vl_plugin.environment import parse
from verl_qwen3vl_plugin.patches.qwen3_vl_nested_position_ids.replacement import (
    canonical_micro_batches,
    maybe_fix_3d_position_ids,
    sequence_ragged,
)
from verl_qwen3vl_plugin.patches.qwen3_vl_nested_position_ids.selftest import engine_rows, packed_batch, run, samples
from verl_qwen3vl_plugin.patches.qwen3_vl_nested_position_ids.spec import FUNCTION, PATCH, probe_function

HERE = Path(__file__).parent  # this patch's child scripts

VERL_FIX = getattr(tensordict_utils, FUNCTION, None)  # verl 0.7.0 has none
NEEDS_VERL_FIX = pytest.mark.skipif(VERL_FIX is None, reason=f"this verl has no {FUNCTION} (verl 0.7.0)")
EQUAL, MIXED = [6, 6, 6, 6], [6, 9, 2, 6]


@pytest.mark.parametrize("lengths", [EQUAL, MIXED, [7], [1, 1]], ids=["equal", "mixed", "one", "one_token_each"])
def test_engine_reads_every_sample_in_order(lengths):
    rows, error = engine_rows(maybe_fix_3d_position_ids, lengths)
    assert not error and torch.equal(rows, torch.cat(samples(lengths), dim=-1))
    batch = packed_batch(lengths)
    maybe_fix_3d_position_ids(batch)
    for got, want in zip(batch["position_ids"].unbind(), samples(lengths), strict=True):
        assert torch.equal(got, want)


@NEEDS_VERL_FIX
def test_verl_breaks_equal_lengths_and_keeps_mixed():
    """The control: verl's own function on the same batches. Mixed lengths it keeps right (as the plugin does);
    equal lengths (rope-packed) it leaves unreadable."""
    rows, error = engine_rows(VERL_FIX, MIXED)
    assert not error and torch.equal(rows, torch.cat(samples(MIXED), dim=-1))
    rows, error = engine_rows(VERL_FIX, EQUAL)
    assert error or rows.shape != (4, sum(EQUAL)), "verl's function now handles rope-packed position_ids"


def test_sequence_packed_with_index_reset_is_what_verl_fixed():
    """The pickle round-trip state verl's function exists for: values and offsets right, index reset to 1."""
    right = sequence_ragged(torch.nested.as_nested_tensor(samples(EQUAL), layout=torch.jagged))
    reset = torch.nested.nested_tensor_from_jagged(right.values(), offsets=right.offsets())
    fixed = sequence_ragged(reset)
    assert fixed._ragged_idx == 2 and torch.equal(fixed.values(), right.values())
    assert sequence_ragged(fixed) is fixed  # canonical input passes through untouched


def test_micro_batch_split_after_the_fix():
    """verl's own split into micro-batches, where this verl has it, reads the fixed batch sample by sample."""
    chunk = getattr(tensordict_utils, "chunk_tensordict", None)
    if chunk is None:
        pytest.skip("this verl has no tensordict_utils.chunk_tensordict")
    batch = packed_batch(EQUAL)
    maybe_fix_3d_position_ids(batch)
    parts = [p for td in chunk(batch, 2) for p in td["position_ids"].unbind()]
    assert all(torch.equal(got, want) for got, want in zip(parts, samples(EQUAL), strict=True))


@NEEDS_VERL_FIX
@pytest.mark.parametrize("ours", [True, False], ids=["plugins", "verls_own"])
@pytest.mark.parametrize("lengths", [EQUAL, MIXED, [6, 9, 4, 4]], ids=["equal", "mixed", "mixed_with_an_equal_pair"])
def test_engine_micro_batches_read_right(ours, lengths):
    """The fixed batch through verl's FSDP engine's own split (``prepare_micro_batches``, fixed micro-batch size):
    each micro-batch's values are what the engine reads, (4 rope rows, its tokens) in sample order. verl 0.7's
    split rebuilds with ``as_nested_tensor`` and rope-packs an equal-length pair again: verl's own split fails there,
    the one the plugin gives the engine does not."""
    from verl.workers.engine.fsdp import transformer_impl as engine

    split = canonical_micro_batches(engine.prepare_micro_batches) if ours else engine.prepare_micro_batches
    batch = packed_batch(lengths)
    maybe_fix_3d_position_ids(batch)  # the callers' fix, before the split
    tensordict_utils.assign_non_tensor(batch, use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
    micro_batches, _ = split(batch)
    read = [tuple(mb["position_ids"].values().shape) for mb in micro_batches]
    want = [(4, sum(lengths[i : i + 2])) for i in range(0, len(lengths), 2)]
    repacks = (
        VERL.release < (0, 8) and not ours and any(lengths[i] == lengths[i + 1] for i in range(0, len(lengths), 2))
    )
    assert (read == want) is not repacks, read


def test_consolidated_locked_batch_after_a_pickle_round_trip():
    """The state verl's function was written for, as verl ships a batch: consolidated (locked), pickled, unpickled;
    and a locked batch whose layout needs a rebuild."""
    import pickle

    batch = packed_batch(MIXED).consolidate()
    batch = pickle.loads(pickle.dumps(batch))
    maybe_fix_3d_position_ids(batch)
    assert all(torch.equal(got, want) for got, want in zip(batch["position_ids"].unbind(), samples(MIXED), strict=True))
    locked = packed_batch(EQUAL).lock_()
    maybe_fix_3d_position_ids(locked)
    assert locked.is_locked and torch.equal(locked["position_ids"].values(), torch.cat(samples(EQUAL), dim=-1))


@NEEDS_VERL_FIX
def test_in_effect_where_verls_engine_calls_it():
    """A fresh process as users run it: verl's engine worker and engine call the plugin's function, and an
    equal-length batch reads right; the control with the plugin off reproduces verl's failure."""
    result = child_json(HERE / "nested_position_ids_in_effect.py")
    assert "verl.workers.engine.base" in result["plugins"] and all(result["plugins"].values()), result
    assert ("verl.workers.engine_workers_tinker" in result["plugins"]) is (VERL.release >= (0, 9)), result
    assert result["rows"] == [4, 15] and set(result["plugins"]) <= set(result["applied"]), result
    assert result["micro_batches"] == [[4, 10], [4, 10]], result  # verl 0.7's split: patched; 0.8's: kept
    off = child_json(
        HERE / "nested_position_ids_in_effect.py",
        env={"VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_QWEN3VL_PLUGIN_AUTOLOAD": "0"},
    )
    assert not any(off["plugins"].values()) and off["rows"] != [4, 15]


def test_unknown_layout_is_a_clear_error():
    odd = torch.nested.nested_tensor_from_jagged(torch.zeros(9, 5), offsets=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="position_ids: a 3-d nested tensor in no known layout"):
        sequence_ragged(odd)


def test_selftest_passes():
    assert all(check.ok for check in run()), run()


VERL_BODY = """
def maybe_fix_3d_position_ids(data: TensorDict):
    # note for tensordict with pickle/unpickle.
    if "position_ids" in data.keys() and data["position_ids"].dim() == 3 and data["position_ids"].is_nested:
        data["position_ids"]._ragged_idx = 2
"""


# verl#7901's shape as its description tells it (no code of it can be read): the function hands the batch to a
# normalizer defined beside it. The probe knows no such shape and fails closed.
VERL_7901 = """
def normalize_3d_position_ids(data):
    ids = data["position_ids"]
    data["position_ids"] = torch.nested.nested_tensor_from_jagged(ids.values(), offsets=ids.offsets(), jagged_dim=2)

def maybe_fix_3d_position_ids(data):
    normalize_3d_position_ids(data)
"""


@pytest.mark.parametrize(
    ("text", "verdict"),
    [
        (VERL_BODY, "apply"),
        (VERL_BODY.replace("._ragged_idx = 2", "._ragged_idx = 1"), "unrecognized"),
        (VERL_BODY.replace("dim() == 3", "dim() == 30"), "unrecognized"),
        (
            VERL_BODY.replace('and data["position_ids"].is_nested', 'and not data["position_ids"].is_nested'),
            "unrecognized",
        ),
        (VERL_BODY + "    data['x'] = 1\n", "unrecognized"),
        (VERL_BODY.replace("(data: TensorDict)", "(data, key)"), "unrecognized"),
        (VERL_7901, "unrecognized"),
        ("def other(data):\n    pass\n", "unrecognized"),
    ],
    ids=[
        "verl", "other_index", "other_dim", "not_nested", "more_statements", "other_signature", "verl_7901", "absent",
    ],
)  # fmt: skip
def test_probe_knows_verls_shapes(text, verdict):
    assert probe_function(parse(text).tree).verdict.value == verdict


CALLER = "from verl.utils.tensordict_utils import maybe_fix_3d_position_ids\n\nclass TrainingWorker:\n    pass\n"


@pytest.mark.parametrize(
    ("text", "verdict"),
    [
        ("class TrainingWorker:\n    pass\n", "not_used"),  # verl 0.7.0
        ("class TrainingWorker:\n    def f(self, data):\n        maybe_fix_3d_position_ids(data)\n", "unrecognized"),
        ("class Other:\n    pass\n", "unrecognized"),
        ("x = 1\n", "unrecognized"),
    ],
    ids=["verl_0_7_0", "calls_unimported", "other_class", "synthesized"],
)
def test_probe_knows_the_callers(text, verdict):
    target = next(t for t in PATCH.targets if t.module == "verl.workers.engine_workers")
    assert decide_text(PATCH, target, text).verdict.value == verdict


def test_a_caller_that_imports_the_function_is_judged_by_its_body():
    target = next(t for t in PATCH.targets if t.module == "verl.workers.engine_workers")
    expected = "apply" if VERL_FIX is not None else "unrecognized"
    assert decide_text(PATCH, target, CALLER).verdict.value == expected
