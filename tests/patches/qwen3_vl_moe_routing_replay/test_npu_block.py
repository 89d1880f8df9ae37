"""``qwen3_vl_moe_routing_replay`` on verl's real Ascend ``npu_patch``, run on the CPU through reference ``torch_npu``
ops: the NPU block, its third router, replays the record.

verl's npu_patch rewires transformers' Qwen3 modules for the rest of the process, so this module runs in a pytest
process of its own (marker ``fake_npu``; see noxfile.py), with the ``npu`` fixture (``tests/npu_fixture.py``).
"""

from __future__ import annotations

import pytest
import torch

from tests.npu_fixture import npu_model
from verl_qwen3vl_plugin.selftest.tiny_models import MOE_TEXT

pytestmark = pytest.mark.fake_npu


def test_routing_replay_routes_verls_npu_block_by_the_record(npu):
    """Routing replay's third router: verl's Ascend block takes its top-k ids from the record (all-equal rows of no
    record keep the block's own), in training, and its gate still gets a gradient."""
    from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay import routes
    from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay import spec as replay_patch
    from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay.selftest import chosen_experts
    from verl_qwen3vl_plugin.registry import watch_patches

    watch_patches([replay_patch.PATCH], frozenset())  # npu_patch is imported: its target acts right away
    model = npu_model(npu, "hidden_ne_2i").train()
    slots = routes.slots(model)
    assert {type(router) for router in slots} == {npu.npu_block}
    ids = torch.arange(1, 13).remainder(MOE_TEXT["vocab_size"]).unsqueeze(0)
    experts, k = MOE_TEXT["num_experts"], MOE_TEXT["num_experts_per_tok"]
    generator = torch.Generator().manual_seed(4)
    record = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(12 * len(slots))])
    record = record.view(12, len(slots), k)
    record[-1] = 0  # the last token: no record
    routes.begin(routes.Routes(slots, record))
    try:
        with chosen_experts(model) as chosen:
            model(input_ids=ids, labels=ids).loss.backward()
    finally:
        routes.begin(None)
    for layer, calls in enumerate(chosen):
        assert torch.equal(calls[0][:-1], record[:-1, layer]), layer
        assert len(set(calls[0][-1].tolist())) == k  # the block's own top-k for the unrecorded token
    assert all(block.gate.weight.grad.abs().sum() > 0 for block in slots)
    # Replaying the block's own routes gives its own numbers: the experts get the weights in the form they read.
    model.zero_grad()
    with chosen_experts(model) as own:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    routes.begin(routes.Routes(slots, torch.stack([calls[0] for calls in own], dim=1)))
    try:
        replayed = model(input_ids=ids, labels=ids).loss
        replayed.backward()
    finally:
        routes.begin(None)
    torch.testing.assert_close(replayed, loss, rtol=0, atol=0)
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-6, atol=1e-7, msg=name)
