"""verl's real Ascend ``npu_patch`` run on the CPU through reference ``torch_npu`` ops, without and with the plugin:
its Qwen3-VL-MoE block against transformers' own (weights copied with the layout mapping on transformers 5), a whole
tiny model, and what verl's FSDP engine streams to the rollout.

verl's npu_patch rewires transformers' Qwen3 modules for the rest of the process, so this module runs in its own
pytest process (marker ``fake_npu``; see noxfile.py). References are computed before verl swaps the block. Last, the
near-misses of the routing and weight-sync shapes their probes call safe (``tests/source_edits.py``).
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import judge, source_text
from tests.source_edits import (
    APPLY,
    Shape,
    Variant,
    add_method,
    before_return,
    check_near_miss,
    extra_parameter,
    guard_scatter,
    in_class,
    in_method,
    near_miss_cases,
    prepend_to,
    rename_stream_keys,
    scatter_not_in_place,
    scatter_unless_training,
    substitute,
    unpermute_with_float_weights,
)
from verl_qwen3vl_plugin.hooks import watch_group
from verl_qwen3vl_plugin.patches.npu_qwen3_vl_moe_routing import spec as routing
from verl_qwen3vl_plugin.patches.npu_qwen3_vl_moe_weight_sync import spec as sync
from verl_qwen3vl_plugin.registry import NPU, Status, Verdict, patch_statuses
from verl_qwen3vl_plugin.selftest.moe_blocks import (
    block_input,
    block_pair,
    engine_weight_stream,
    npu_layout,
    on_the_cpu,
    run_block,
)
from verl_qwen3vl_plugin.selftest.npu_qwen3_vl_moe import block_check, weight_sync_check
from verl_qwen3vl_plugin.selftest.npu_reference import fake_torch_npu
from verl_qwen3vl_plugin.selftest.tiny_models import MOE_TEXT, randomize, tiny_qwen3_vl_moe

pytestmark = pytest.mark.fake_npu
NPU_PATCH = "verl.models.transformers.npu_patch"
FSDP_UTILS, FSDP_ENGINE = "verl.workers.engine.fsdp.utils", "verl.workers.engine.fsdp.transformer_impl"
SYNC_UTILS, SYNC_ENGINE = sync.PATCH.target(FSDP_UTILS), sync.PATCH.target(FSDP_ENGINE)  # the full weight sync
SHARD_EXPORT = sync.PATCH.target(f"{FSDP_ENGINE}:FSDPEngine.get_per_tensor_param_shard")
SYNCS = judge(sync.PATCH, SYNC_UTILS, source_text(FSDP_UTILS)).verdict is Verdict.APPLY
# The tiny model's hidden 32 with expert intermediates 24 (shapes tell a mis-split) and 16 (hidden == 2 * I: they
# do not, and only the values show it).
INTERMEDIATES = {"hidden_ne_2i": 24, "hidden_eq_2i": 16}


def whole_model_loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = torch.arange(1, 13).remainder(MOE_TEXT["vocab_size"]).unsqueeze(0)
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def npu():
    with fake_torch_npu():
        from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as hf

        hf_block = hf.Qwen3VLMoeTextSparseMoeBlock
        reference = randomize(tiny_qwen3_vl_moe(), seed=0)
        ref_loss, ref_grads = whole_model_loss_and_grads(reference)
        states, streams = {}, {}
        for case, intermediate in INTERMEDIATES.items():
            model = randomize(tiny_qwen3_vl_moe(moe_intermediate_size=intermediate), seed=1)
            states[case] = model.state_dict()
            if SYNCS:  # verl's own weight stream of transformers' own model: what the rollout must receive
                streams[case] = engine_weight_stream(model)
        npu_patch = importlib.import_module(NPU_PATCH)
        getattr(npu_patch, "apply_npu_patches", lambda: None)()  # verl >= 0.9 swaps the block here, 0.8 at import
        block = npu_patch.NPUQwen3VLMoeTextSparseMoeBlock
        verl_forward = block.forward
        experts = npu_patch.NPUQwen3VLMoeTextExperts
        verl_experts_forward = experts.forward
        engine = importlib.import_module(FSDP_ENGINE)  # verl's FSDP engine: the weight-sync patch's targets
        verl_unfuse = getattr(engine, "unfuse_moe_params", None)
        watch_group(NPU)  # npu_patch is already imported: the hooks act right away
        yield SimpleNamespace(
            hf_block=hf_block,
            npu_block=block,
            verl_forward=verl_forward,
            patched=block.forward is not verl_forward,
            experts=experts,
            verl_experts_forward=verl_experts_forward,
            state=reference.state_dict(),
            ref_loss=ref_loss,
            ref_grads=ref_grads,
            states=states,
            streams=streams,
            engine=engine,
            verl_unfuse=verl_unfuse,
        )


def test_statuses_match_the_installed_verl(npu):
    statuses = {(s.patch, s.target): s for s in patch_statuses()}
    status = statuses[routing.PATCH.name, NPU_PATCH]
    if npu.patched:
        assert status.status is Status.APPLIED, status
    else:
        assert (status.status, status.verdict) == (Status.SKIPPED, Verdict.FIXED_UPSTREAM), status
        assert npu.npu_block.forward is npu.verl_forward
    for target in (SYNC_UTILS, SYNC_ENGINE):
        status = statuses[sync.PATCH.name, target.label]
        assert status.status is (Status.APPLIED if SYNCS else Status.SKIPPED), status
    status = statuses[sync.PATCH.name, SHARD_EXPORT.label]
    assert status.status is (Status.UNRECOGNIZED if SYNCS else Status.SKIPPED), status
    for status in statuses.values():  # applied here, yet this machine has no NPU: never run in a real process
        if status.status is Status.APPLIED:
            assert status.dormant == "code for npu devices, and this machine has none", status


def affected(npu):
    if not npu.patched:
        pytest.skip("this verl's NPU block scatters in training; nothing to fix")


def test_bug_without_plugin_index_error_when_experts_outnumber_top_k(npu):
    affected(npu)
    _, block = block_pair(npu.hf_block, npu.npu_block, num_experts=4)
    with pytest.raises(IndexError):
        run_block(block, block_input(), training=True, forward=npu.verl_forward)


def test_bug_without_plugin_wrong_numbers_when_experts_equal_top_k(npu):
    affected(npu)
    hf, block = block_pair(npu.hf_block, npu.npu_block, num_experts=MOE_TEXT["num_experts_per_tok"])
    verl = run_block(block, block_input(), training=True, forward=npu.verl_forward)
    assert not torch.allclose(verl.out, run_block(hf, block_input(), training=True).out, atol=1e-3)


@pytest.mark.parametrize("num_experts", [4, 2], ids=["experts_gt_top_k", "experts_eq_top_k"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_block_matches_transformers_outputs_and_gradients(npu, num_experts, training):
    hf, block = block_pair(npu.hf_block, npu.npu_block, num_experts)
    check = block_check("block", run_block(block, block_input(), training), run_block(hf, block_input(), training))
    assert check.ok, check.detail


def test_whole_model_loss_and_gradients_match_transformers(npu):
    """A tiny Qwen3-VL-MoE built after verl's npu_patch (NPU block, RMSNorm, RoPE) trains like transformers'."""
    model = tiny_qwen3_vl_moe()
    assert type(model.model.language_model.layers[0].mlp) is npu.npu_block
    model.load_state_dict(npu_layout(npu.state))
    loss, grads = whole_model_loss_and_grads(model)
    grads = npu_layout(grads)
    torch.testing.assert_close(loss, npu.ref_loss, rtol=1e-5, atol=1e-5)
    assert grads.keys() == npu.ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, npu.ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def npu_model(npu, case: str) -> torch.nn.Module:
    model = tiny_qwen3_vl_moe(moe_intermediate_size=INTERMEDIATES[case])
    assert type(model.model.language_model.layers[0].mlp) is npu.npu_block
    model.load_state_dict(npu_layout(npu.states[case]))
    return model


needs_sync = pytest.mark.skipif(not SYNCS, reason="this verl streams packed experts as stored (no unfuse_moe_params)")


@needs_sync
@pytest.mark.parametrize("case", list(INTERMEDIATES))
def test_weight_sync_sends_exactly_transformers_experts(npu, case):
    """verl's real ``FSDPEngine.get_per_tensor_param`` on the NPU model equals its stream of transformers' model."""
    check = weight_sync_check("sync", engine_weight_stream(npu_model(npu, case)), npu.streams[case])
    assert check.ok, check.detail


@needs_sync
@pytest.mark.parametrize("case", list(INTERMEDIATES))
def test_weight_sync_bug_without_plugin(npu, case, monkeypatch):
    """The control: with verl's own split the per-expert tensors are wrong, in shape or, when hidden == 2I, in value."""
    monkeypatch.setattr(npu.engine, "unfuse_moe_params", npu.verl_unfuse)
    actual, expected = engine_weight_stream(npu_model(npu, case)), npu.streams[case]
    check = weight_sync_check("sync", actual, expected)
    assert not check.ok
    gate = next(k for k in expected if k.endswith("experts.0.gate_proj.weight"))
    assert (actual[gate].shape == expected[gate].shape) is (case == "hidden_eq_2i"), check.detail


@needs_sync
def test_shard_export_sends_the_npu_layout_and_reads_unrecognized(npu):
    """verl 0.9's real ``get_per_tensor_param_shard`` sends the NPU experts' packed (E, H, 2I) tensor under
    transformers 5's name, where transformers 5's model has (E, 2I, H): what the delta checkpoint engine would load.
    The plugin cannot transpose a flat shard, so the verdict says so instead of "fine"."""
    from verl.workers.engine.fsdp import transformer_impl

    model = npu_model(npu, "hidden_ne_2i")
    engine = SimpleNamespace(module=model, _uses_fsdp2_cpu_offload_policy=True, _is_offload_param=False)
    with on_the_cpu(transformer_impl):
        stream, _ = transformer_impl.FSDPEngine.get_per_tensor_param_shard(engine)
        specs = {name: spec for name, _, spec in stream}
    name = next(n for n in specs if n.endswith("layers.0.mlp.experts.gate_up_proj"))
    hf_shape = tuple(npu.states["hidden_ne_2i"][name].shape)  # transformers 5's own model
    assert tuple(specs[name].full_shape) == (hf_shape[0], hf_shape[2], hf_shape[1]) != hf_shape
    decision = judge(sync.PATCH, SHARD_EXPORT, source_text(FSDP_ENGINE))
    assert decision.verdict is Verdict.UNRECOGNIZED, decision
    assert decision.shape == "shard-export-delta-checkpoint-engines-export" and "not patched" in decision.reason


def test_weight_sync_wrapper_passes_through_what_it_does_not_read(npu):
    """An ``unfuse_moe_params`` with a parameter the wrapper does not know (the fixture made transformers' module build
    verl's NPU block): it reads ``model_type`` by name and hands every argument on as given."""
    from verl_qwen3vl_plugin.patches.npu_qwen3_vl_moe_weight_sync.replacement import layout_aware

    seen = {}

    def unfuse(weights, model_type=None, *, layout="packed"):
        seen.update(model_type=model_type, layout=layout)
        return list(weights)

    tensor = torch.zeros(2, 3, 4)
    out = layout_aware(unfuse)(iter([("a.mlp.experts.down_proj", tensor)]), "qwen3_vl_moe", layout="split")
    assert seen == {"model_type": "qwen3_vl_moe", "layout": "split"}
    assert out[0][1].shape == (2, 4, 3)  # the NPU layout transposed to transformers 5's before verl's split


@needs_sync
def test_an_extra_parameter_of_verls_split_still_applies():
    """The probe checks what the wrapper relies on (``weights`` first, a ``model_type``), not the whole signature."""
    source = source_text(FSDP_UTILS)
    old = "def unfuse_moe_params(weights, model_type: str | None = None):"
    assert old in source
    edited = source.replace(old, "def unfuse_moe_params(weights, model_type: str | None = None, *, layout='packed'):")
    assert judge(sync.PATCH, SYNC_UTILS, edited).verdict is Verdict.APPLY
    without = source.replace(old, "def unfuse_moe_params(weights, kind: str | None = None):")
    assert judge(sync.PATCH, SYNC_UTILS, without).verdict is Verdict.UNRECOGNIZED


def test_experts_eval_is_grouped(npu):
    assert npu.experts.forward is not npu.verl_experts_forward
    assert npu.experts.forward.__wrapped__ is npu.verl_experts_forward


@pytest.mark.parametrize("num_experts", [4, 2], ids=["experts_gt_top_k", "experts_eq_top_k"])
def test_grouped_eval_matches_verl_dense_eval(npu, num_experts, monkeypatch):
    _, block = block_pair(npu.hf_block, npu.npu_block, num_experts)
    grouped = run_block(block, block_input(), training=False)
    monkeypatch.setattr(npu.experts, "forward", npu.verl_experts_forward)
    check = block_check("eval", grouped, run_block(block, block_input(), training=False))
    assert check.ok, check.detail


def test_grouped_eval_output_bit_identical_to_training(npu):
    _, block = block_pair(npu.hf_block, npu.npu_block, num_experts=4)
    evaluation, training = run_block(block, block_input(), False), run_block(block, block_input(), True)
    assert torch.equal(evaluation.out, training.out)


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


BLOCK, EXPERTS = "NPUQwen3VLMoeTextSparseMoeBlock", "NPUQwen3VLMoeTextExperts"
BLOCK_EXTRA_ARGUMENT = Variant(
    "extra argument to the block", NPU_PATCH, in_method(BLOCK, "forward", extra_parameter("padding_mask"))
)
FULL = ("FSDPEngine", "get_per_tensor_param")  # the full export, which streams every parameter
STORED_STREAM = (  # near-misses of verl 0.7/0.8's stream, its packed experts as stored
    Variant(
        "split by a helper of another name",
        FSDP_ENGINE,
        in_method(*FULL, before_return("per_tensor_param = split_experts(per_tensor_param)")),
    ),
    Variant("keys renamed", FSDP_ENGINE, in_method(*FULL, rename_stream_keys)),
    Variant(
        "unfused, with no unfuse_moe_params to wrap",
        FSDP_ENGINE,
        in_method(*FULL, before_return("per_tensor_param = unfuse_moe_params(per_tensor_param, 'qwen3_vl_moe')")),
    ),
)
NEAR_MISSES = [
    Shape(
        routing.PATCH.name,
        NPU_PATCH,
        "verl0.8-scatters",
        (
            Variant("scatter not in place", NPU_PATCH, in_method(BLOCK, "forward", scatter_not_in_place)),
            # The scatter guarded as in verl 0.7.1, with experts that read the dense matrix: the patch's case.
            Variant(
                "scatter under a conditional expression",
                NPU_PATCH,
                in_method(BLOCK, "forward", scatter_unless_training),
            ),
            Variant("scatter only in eval", NPU_PATCH, in_method(BLOCK, "forward", guard_scatter), APPLY),
            BLOCK_EXTRA_ARGUMENT,
            Variant(
                "extra argument to the experts",
                NPU_PATCH,
                in_method(EXPERTS, "forward", extra_parameter("expert_mask")),
            ),
        ),
    ),
    Shape(
        routing.PATCH.name,
        NPU_PATCH,
        "verl0.7.0-top-k-experts",
        (
            Variant(
                "unpermuted with another weight", NPU_PATCH, in_method(EXPERTS, "forward", unpermute_with_float_weights)
            ),
            Variant(
                "experts also read the dense matrix",
                NPU_PATCH,
                prepend_to(EXPERTS, "forward", "picked = routing_weights[batch_idx, router_indices]"),
            ),
            BLOCK_EXTRA_ARGUMENT,
        ),
    ),
    *(Shape(sync.PATCH.name, t.label, "verl0.8-sends-as-stored", STORED_STREAM) for t in (SYNC_UTILS, SYNC_ENGINE)),
    Shape(
        sync.PATCH.name,
        SHARD_EXPORT.label,
        "verl0.8-no-shard-export",
        (
            Variant(
                "another method reads the state dict",
                FSDP_ENGINE,
                in_class("FSDPEngine", add_method("def export_shards(self):\n    return self.module.state_dict()")),
            ),
            Variant(
                "a method reads it through another function",
                FSDP_ENGINE,
                in_class(
                    "FSDPEngine", add_method("def export_shards(self):\n    return get_model_state_dict(self.module)")
                ),
            ),
            Variant(
                "a shard export on another class",
                FSDP_ENGINE,
                in_class(
                    "FSDPEngineWithLMHead", add_method("def get_per_tensor_param_shard(self):\n    return iter(())")
                ),
            ),
            Variant(
                "renamed full export", FSDP_ENGINE, substitute(r"def get_per_tensor_param\(", "def export_weights(")
            ),
        ),
    ),
]


@pytest.mark.parametrize(("patch", "target", "variant"), near_miss_cases(NEAR_MISSES))
def test_near_miss_of_a_safe_shape_is_not_called_safe(monkeypatch, patch, target, variant):
    check_near_miss(monkeypatch, patch, target, variant)
