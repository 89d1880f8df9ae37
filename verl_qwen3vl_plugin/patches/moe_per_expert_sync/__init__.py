"""Patch ``moe_per_expert_sync``: its spec (``spec.PATCH``), its replacement code and its self-test."""
