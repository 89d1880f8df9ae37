"""``maybe_fix_3d_position_ids`` leaves a batch's multimodal ``position_ids`` ragged along the sequence when every
sample has one length (GRPO's n responses cut at the same maximum). TransferQueue packs each sample's ``(4, seq)``
ids with ``torch.nested.as_nested_tensor(..., layout=torch.jagged)``, and with equal lengths torch makes the 4 rope
rows the ragged dimension; relabelling that tensor as sequence-ragged, without moving its values, made an
inconsistent one, on which the engine failed (a ``split_with_sizes`` error, or a rotary shape mismatch). Also in a
locked TensorDict, as a consolidated batch is. Before the fix each sample's ids no longer came back."""

import pytest
import torch
from tensordict import TensorDict
from verl.utils.tensordict_utils import maybe_fix_3d_position_ids

LENGTH, SAMPLES = 5, 3


@pytest.mark.parametrize("locked", [False, True])
def test_equal_length_rope_packed_position_ids_become_sequence_ragged(locked):
    samples = [torch.arange(4 * LENGTH).reshape(4, LENGTH) + 100 * i for i in range(SAMPLES)]
    packed = torch.nested.as_nested_tensor(samples, layout=torch.jagged)  # as TransferQueue packs them
    data = TensorDict({"position_ids": packed}, batch_size=[SAMPLES])
    if locked:
        data.lock_()

    maybe_fix_3d_position_ids(data)

    fixed = data["position_ids"]
    assert fixed._ragged_idx == 2
    assert fixed.values().shape == (4, SAMPLES * LENGTH)
    assert fixed.offsets().tolist() == [LENGTH * i for i in range(SAMPLES + 1)]
    for got, expected in zip(fixed.unbind(), samples, strict=True):
        assert torch.equal(got, expected)
    assert data.is_locked == locked
