"""Patch ``qwen3_vl_moe_sparse_experts``: its spec (``spec.PATCH``), its replacement code and its self-test."""
