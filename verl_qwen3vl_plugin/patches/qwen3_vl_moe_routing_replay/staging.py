"""``qwen3_vl_moe_routing_replay`` as a verl pull request: read by ``scripts/upstream.py``.

**This pull request** covers verl's FSDP engine (``FSDPEngine`` / ``FSDPEngineWithLMHead``, the path verl main trains
FSDP runs through) with the transformers 5 top-k routers of Qwen3-VL-MoE and Qwen3.5-MoE, the releases verl main
pins: R2 and R3, remove-padding, Ulysses, dynamic batches, checkpoint recompute, and R3's check that the rollout's
record fits its samples. It leaves out what the plugin also runs for older stacks: verl 0.7's legacy
``DataParallelPPOActor`` and its worker (the release/v0.7 branch), transformers 4.57's self-routing sparse block, and
verl's Ascend ``NPUQwen3VLMoeTextSparseMoeBlock``. The engine still reads the setting from its own config,
``actor_rollout_ref.actor.fsdp_config.router_replay.mode`` (``+`` in front while the FSDP engine's YAML does not
declare the group); ``engine_workers.py``'s ``enable_routing_replay`` flag, which only the Megatron and VeOmni engines
read, is left as it is.
"""

from verl_qwen3vl_plugin.families import QWEN3_5_MOE, QWEN3_VL_MOE
from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay import (
    engine,
    layout,
    rollout_record,
    routers,
    routes,
    session,
)
from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay.spec import (
    ENGINE_CLASS,
    ENGINE_LM_CLASS,
    PATCH,
    QWEN3_5_ROUTER,
    ROUTER,
)
from verl_qwen3vl_plugin.staging import Benchmark, CallAfter, Decorate, NewModule, Overlap, StagedTest, Staging

PACKAGE = "verl/utils/router_replay"
ENGINE = "verl/workers/engine/fsdp/transformer_impl.py"
MONKEY_PATCH = "verl/models/transformers/monkey_patch.py"


def _hook(router: str):
    """The plugin's hook that makes ``router`` replay-aware when transformers imports its module."""
    return next(t.apply for t in PATCH.targets if t.name == f"{router}.forward")


STAGING = Staging(
    base="verl==0.9.1",
    modules=("fsdp", "model"),
    type="feat",
    description="routing replay (R2 / R3) for Qwen3-VL-MoE and Qwen3.5-MoE on the FSDP engine",
    edits=(
        # The replay's core, each plugin module a module of verl's new package, in import order ...
        NewModule(
            file=f"{PACKAGE}/routes.py",
            source=routes,
            replace=(
                ('"_verl_qwen3vl_plugin_replay_aware"', '"_verl_replay_aware"'),
                ("whose forward the plugin made replay-aware", "whose forward verl made replay-aware"),
                ("after the plugin patched it", "after verl patched it"),
                (
                    "the plugin patched \"\n            \"(Qwen3-VL-MoE's sparse block or top-k router, Qwen3.5-MoE's "
                    'top-k router, or verl\'s Ascend sparse block); "\n            "see `verl-qwen3vl-plugin doctor`',
                    "verl made replay-aware \"\n            \"(Qwen3-VL-MoE's and Qwen3.5-MoE's top-k routers)",
                ),
            ),
        ),
        NewModule(
            file=f"{PACKAGE}/rollout_record.py",
            source=rollout_record,
            replace=(("VERL_QWEN3VL_PLUGIN_R3_MAX_FALLBACK", "VERL_ROUTER_REPLAY_MAX_FALLBACK"),),
        ),
        NewModule(
            file=f"{PACKAGE}/session.py",
            source=session,
            replace=(("(verl 0.7's legacy actor, the FSDP engine of\nverl >= 0.8)", "(here the FSDP\nengine)"),),
        ),
        NewModule(file=f"{PACKAGE}/layout.py", source=layout),
        # ... the top-k routers' replay-aware forward (the routers verl main's transformers has) ...
        NewModule(
            file=f"{PACKAGE}/routers.py",
            source=routers,
            names=("_replay_aware", "top_k_router_replay", "patch_top_k_router"),
            paragraphs=1,
            replace=(
                ("the four MoE routers the plugin meets", "the MoE top-k routers of Qwen3-VL-MoE and Qwen3.5-MoE"),
                (
                    "    # Around the forward installed now. On Ascend verl 0.7.1 the routing fix may replace it later "
                    "(the NPU hook runs\n    # after the model hook); its forward routes through routes.top_k, so "
                    'replay still acts there.\n    originals.replace(cls, "forward", routes.mark(forward))',
                    "    cls.forward = routes.mark(forward)",
                ),
            ),
            note=(
                "The plugin sets the forward through its `originals.replace` (`setattr`, keeping upstream's for its "
                "doctor); here it is set directly."
            ),
        ),
        NewModule(file=f"{PACKAGE}/fsdp_engine.py", source=engine),
        # ... verl's monkey patch makes the routers replay-aware where it patches those models ...
        CallAfter(
            file=MONKEY_PATCH,
            scope="apply_monkey_patch",
            after="Qwen3VLMoeForConditionalGeneration.forward = forward_with_normal_backend",
            function="patch_top_k_router",
            classes=(f"{QWEN3_VL_MOE.modeling}.{ROUTER}",),
            source=_hook(ROUTER),
        ),
        CallAfter(
            file=MONKEY_PATCH,
            scope="apply_monkey_patch",
            after="Qwen3_5MoeModel.forward = qwen3_5_base_forward",
            function="patch_top_k_router",
            classes=(f"{QWEN3_5_MOE.modeling}.{QWEN3_5_ROUTER}",),
            source=_hook(QWEN3_5_ROUTER),
        ),
        # ... and the FSDP engine lays the record out as it lays out the tokens.
        *(
            Decorate(
                file=ENGINE,
                functions=(f"{cls}.{method}",),
                decorator=f"router_replay.{method}",
                imports=("from verl.utils.router_replay import fsdp_engine as router_replay",),
            )
            for cls, method in (
                (ENGINE_CLASS, "forward_backward_batch"),
                (ENGINE_LM_CLASS, "prepare_model_inputs"),
                (ENGINE_LM_CLASS, "prepare_model_outputs"),
            )
        ),
    ),
    tests=(
        StagedTest(
            path="tests/workers/engine/test_fsdp_engine_router_replay_on_cpu.py",
            source="tests/patches/qwen3_vl_moe_routing_replay/staged_fsdp_engine_router_replay.py",
        ),
    ),
    order=100,
    benchmark=Benchmark(section="Routing replay", command="nox -s bench_routing_replay"),
    overlaps=(
        Overlap(
            pr="verl#4443",
            state="open",
            advice=(
                "read its design first (known here from its description only): routing replay for Qwen MoE with "
                "SGLang and FSDP, the routes moved between nodes over NCCL point-to-point. This one replays on the "
                "FSDP engine from the routes verl's rollout already records for Megatron and VeOmni "
                "(routed_experts), for Qwen3-VL-MoE and Qwen3.5-MoE, R2 and R3, with a check that each sample's "
                "record fits it; agree on one design with its author before sending."
            ),
        ),
    ),
)
