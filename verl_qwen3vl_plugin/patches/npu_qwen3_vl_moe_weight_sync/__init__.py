"""Patch ``npu_qwen3_vl_moe_weight_sync``: its spec (``spec.PATCH``), its replacement code and its self-test."""
