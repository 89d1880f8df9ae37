"""Routing replay (R2 / R3) for Qwen3-VL-MoE on verl's FSDP path: the routes, the routers that read them, and the
two verl code paths that hand them over (verl 0.7's ``DataParallelPPOActor``, verl >= 0.8's ``FSDPEngine``).

When it applies, and when it can be removed: the ``qwen3_vl_moe_routing_replay`` spec.
"""
