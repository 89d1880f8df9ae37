"""verl's names for routing replay, shared by the patch spec (which imports no torch) and the replay code."""

KEY = "routed_experts"  # verl's batch key: (bsz, seqlen, layers, top_k), or nested (bsz, j, layers, top_k)
ROLLOUT_SETTING = "actor_rollout_ref.rollout.enable_rollout_routing_replay=True"
LEGACY_SWITCH = "actor_rollout_ref.actor.router_replay.mode"  # verl 0.7's actor config
ENGINE_SWITCH = "+actor_rollout_ref.actor.fsdp_config.router_replay.mode"  # verl >= 0.8's FSDP engine config
