"""``qwen3_vl_moe_routing_replay``: near-misses of the shapes its probes call ``not_used``. transformers 5's block
takes its routes from the router (the router target acts), transformers 4.57 has no router class (the block target
acts), and verl >= 0.8 has no legacy actor (the engine target acts): none may pass for a block or an engine that routes
or replays some other way. Replay itself is tested in ``test_replay.py``."""

from __future__ import annotations

import pytest

from tests.source_edits import (
    NearMisses,
    Variant,
    add_method,
    check_near_miss,
    in_class,
    near_miss_cases,
    prepend_to,
    replace,
    substitute,
)

PATCH = "qwen3_vl_moe_routing_replay"
MOE = "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe"
ENGINE = "verl.workers.engine.fsdp.transformer_impl"
LEGACY = ("verl.workers.actor.dp_actor", "verl.workers.fsdp_workers:ActorRolloutRefWorker.compute_log_prob")
REPLAY_MODE = "def replay_mode(self):\n    return self.engine_config.router_replay.mode"
ENGINE_NEAR_MISSES = (
    Variant("the engine reads router_replay", ENGINE, in_class("FSDPEngineWithLMHead", add_method(REPLAY_MODE))),
    Variant(
        "the engine names its pad otherwise",
        ENGINE,
        substitute(r"output_args\[\"pad_size\"\] =", 'output_args["padding"] ='),
    ),
)
NEAR_MISSES = [
    NearMisses(
        PATCH,
        f"{MOE}:Qwen3VLMoeTextSparseMoeBlock.forward",
        "tf5-block-takes-router-routes",
        (
            Variant(
                "the block also takes a top-k",
                MOE,
                prepend_to("Qwen3VLMoeTextSparseMoeBlock", "forward", "torch.topk(hidden_states, 1)"),
            ),
            Variant(
                "renamed router class",
                MOE,
                substitute(r"class Qwen3VLMoeTextTopKRouter\(", "class Qwen3VLMoeTextRouter("),
            ),
        ),
    ),
    NearMisses(
        PATCH,
        f"{MOE}:Qwen3VLMoeTextTopKRouter.forward",
        "tf4.57-no-top-k-router",
        (
            Variant(
                "the block sorts instead of a top-k",
                MOE,
                replace("torch.topk(routing_weights", "torch.sort(routing_weights"),
            ),
            Variant(
                "the block returns one value", MOE, replace("return routed_out, router_logits", "return routed_out")
            ),
        ),
    ),
    # The legacy targets' ``absent`` on verl >= 0.8: near-misses of the engine it reads.
    *(NearMisses(PATCH, target, "verl0.8-no-legacy-actor", ENGINE_NEAR_MISSES) for target in LEGACY),
]


@pytest.mark.parametrize(("patch", "target", "variant"), near_miss_cases(NEAR_MISSES))
def test_near_miss_of_a_safe_shape_is_not_called_safe(monkeypatch, patch, target, variant):
    check_near_miss(monkeypatch, patch, target, variant)
