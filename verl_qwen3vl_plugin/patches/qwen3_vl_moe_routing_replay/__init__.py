"""Patch ``qwen3_vl_moe_routing_replay``: its spec (``spec.PATCH``), its replacement code and its self-test."""
