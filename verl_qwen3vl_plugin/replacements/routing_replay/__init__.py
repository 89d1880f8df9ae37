"""Routing replay (R2 / R3) for Qwen3-VL-MoE on verl's FSDP path: the routes (``routes``), the MoE routing core
(``moe_routing``) and the routers that read them (``routers``), one session per verl call (``session``), and the two
verl code paths that open it (verl 0.7's ``DataParallelPPOActor``, verl >= 0.8's ``FSDPEngine``)."""
