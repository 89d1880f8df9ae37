"""What each patch's probe must conclude on each target, as a function of the stack's verl and transformers releases:
the doctor test checks the installed stack against it, and ``scripts/generate.py`` renders the compatibility matrix
of every stack in ``noxfile.py`` from it. The one place these facts are written."""

from __future__ import annotations

from verl_qwen3vl_plugin.families import QWEN3_5, QWEN3_5_MOE

QWEN3_5_VISION = (QWEN3_5.modeling, QWEN3_5_MOE.modeling)


def expected_verdicts(verl: tuple[int, ...], transformers: tuple[int, ...]) -> dict[str, dict[str, str]]:
    """patch -> target label -> verdict, on verl ``verl`` and transformers ``transformers`` (release tuples)."""
    pos_embed_used = transformers < (5, 9)  # transformers >= 5.9 no longer calls fast_pos_embed_interpolate
    qwen3_5_tf = QWEN3_5.shipped_by(transformers)
    return {
        "qwen3_vl_pos_embed": {
            "transformers.models.qwen3_vl.modeling_qwen3_vl": "apply" if pos_embed_used else "not_used",
            "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe": "apply" if pos_embed_used else "not_used",
            **dict.fromkeys(QWEN3_5_VISION, "apply" if qwen3_5_tf and pos_embed_used else "not_used"),
            "verl.models.transformers.monkey_patch": "apply",  # wrapped on every verl: right whether it sets one or not
        },
        "qwen3_vl_moe_sparse_experts": {
            "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe": "apply"
            if transformers < (5,)
            else "fixed_upstream",
        },
        "qwen3_vl_single_vision_call": {  # verl 0.7.0 to 0.9.1; Qwen3.5 from verl 0.8
            "verl.models.transformers.qwen3_vl": "apply",
            "verl.models.transformers.qwen3_5": "apply" if verl >= (0, 8) else "not_used",
        },
        "qwen3_vl_vision_dp": {  # verl 0.7.0 to 0.9.1 all slice Qwen3-VL inputs after the tower, 0.8 to 0.9.1 Qwen3.5's
            "transformers.models.qwen3_vl.modeling_qwen3_vl": "apply",
            "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe": "apply",
            **dict.fromkeys(QWEN3_5_VISION, "apply" if qwen3_5_tf else "not_used"),
        },
        "dp_actor_dynamic_batch_sync": dict.fromkeys(
            ("verl.workers.actor.dp_actor", "verl.workers.critic.dp_critic"),
            {(0, 7, 0): "fixed_upstream", (0, 7, 1): "apply"}.get(verl, "not_used"),
        ),
        "qwen3_vl_nested_position_ids": {  # verl 0.7.1 to 0.9.1 call maybe_fix_3d_position_ids, 0.7.0 none
            **dict.fromkeys(
                ("verl.workers.engine_workers", "verl.workers.engine.base"),
                "apply" if verl >= (0, 7, 1) else "not_used",
            ),
            "verl.workers.engine_workers_tinker": "apply" if verl >= (0, 9) else "not_used",  # verl 0.9's Tinker worker
            # verl 0.7's micro-batch split rope-packs an equal-length subset again; 0.8 keeps the layout
            "verl.workers.engine.fsdp.transformer_impl": "fixed_upstream"
            if verl >= (0, 8)
            else "apply"
            if verl >= (0, 7, 1)
            else "not_used",
        },
        "qwen3_5_packed_delta_net": {  # no FLA here: verl 0.9's forward wrapped, verl 0.8's transformers layers
            "verl.models.transformers.qwen3_5": "apply" if verl >= (0, 9) else "not_used",
            **dict.fromkeys(
                (
                    "transformers.models.qwen3_5.modeling_qwen3_5",
                    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
                ),
                "apply" if verl[:2] == (0, 8) else "not_used",
            ),
        },
        "qwen3_5_layer_attributes": dict.fromkeys(  # verl 0.9's own Qwen3.5 layer forwards read the old names
            (QWEN3_5.modeling, QWEN3_5_MOE.modeling),
            ("apply" if transformers >= (5, 13) else "fixed_upstream") if verl >= (0, 9) else "not_used",
        ),
        "qwen3_vl_moe_routing_replay": {  # the router of this transformers; the legacy actor on 0.7, the engine on all
            "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe:Qwen3VLMoeTextSparseMoeBlock.forward": "apply"
            if transformers < (5,)
            else "not_used",
            "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe:Qwen3VLMoeTextTopKRouter.forward": "not_used"
            if transformers < (5,)
            else "apply",
            "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe:Qwen3_5MoeTopKRouter.forward": "apply"
            if qwen3_5_tf
            else "not_used",
            "verl.models.transformers.npu_patch:NPUQwen3VLMoeTextSparseMoeBlock.forward": "apply",
            **dict.fromkeys(
                ("verl.workers.actor.dp_actor", "verl.workers.fsdp_workers:ActorRolloutRefWorker.compute_log_prob"),
                "apply" if verl < (0, 8) else "not_used",
            ),
            "verl.workers.engine.fsdp.transformer_impl": "apply",
        },
        "vision_placeholder_ban": {  # verl 0.7.0 in vllm_rollout, 0.7.1 / 0.8.0 in utils; 0.9 bans upstream
            "verl.workers.rollout.vllm_rollout.utils": "apply"
            if (0, 7, 1) <= verl < (0, 9)
            else "not_used"
            if verl < (0, 7, 1)
            else "fixed_upstream",
            "verl.workers.rollout.vllm_rollout.vllm_rollout": "apply" if verl == (0, 7, 0) else "not_used",
            "verl.experimental.agent_loop.agent_loop": "apply",
        },
        "npu_qwen3_vl_moe_routing": {
            "verl.models.transformers.npu_patch": "apply" if verl == (0, 7, 1) else "fixed_upstream",
        },
        "npu_qwen3_vl_moe_sparse_eval": {"verl.models.transformers.npu_patch": "apply"},
        "npu_qwen3_vl_moe_weight_sync": {
            "verl.workers.engine.fsdp.utils": "apply" if verl >= (0, 9) else "not_used",
            "verl.workers.engine.fsdp.transformer_impl": "apply" if verl >= (0, 9) else "not_used",
            # verl 0.9's shard export sends the NPU layout as stored and cannot be patched where it is cut: reported.
            "verl.workers.engine.fsdp.transformer_impl:FSDPEngine.get_per_tensor_param_shard": "unrecognized"
            if verl >= (0, 9)
            else "not_used",
        },
    }
