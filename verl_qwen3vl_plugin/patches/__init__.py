"""Every patch the plugin ships, one module each; add a patch here once.

The hooks install their group from ``PATCHES``; the doctor, the self-test, the disable names and the docs tests all
iterate over it. Patch modules import no torch: this list is built at ``import verl``.
"""

from verl_qwen3vl_plugin.patches import (
    dp_actor_dynamic_batch_sync,
    npu_qwen3_vl_moe_routing,
    npu_qwen3_vl_moe_sparse_eval,
    npu_qwen3_vl_moe_weight_sync,
    qwen3_5_packed_delta_net,
    qwen3_vl_moe_routing_replay,
    qwen3_vl_moe_sparse_experts,
    qwen3_vl_nested_position_ids,
    qwen3_vl_pos_embed,
    qwen3_vl_single_vision_call,
    qwen3_vl_vision_dp,
    vision_placeholder_ban,
)

PATCHES = (
    qwen3_vl_pos_embed.PATCH,
    qwen3_vl_moe_sparse_experts.PATCH,
    qwen3_vl_single_vision_call.PATCH,
    qwen3_vl_vision_dp.PATCH,
    qwen3_5_packed_delta_net.PATCH,
    dp_actor_dynamic_batch_sync.PATCH,
    qwen3_vl_nested_position_ids.PATCH,
    qwen3_vl_moe_routing_replay.PATCH,
    vision_placeholder_ban.PATCH,
    npu_qwen3_vl_moe_routing.PATCH,
    npu_qwen3_vl_moe_sparse_eval.PATCH,
    npu_qwen3_vl_moe_weight_sync.PATCH,
)
NAMES = tuple(patch.name for patch in PATCHES)
