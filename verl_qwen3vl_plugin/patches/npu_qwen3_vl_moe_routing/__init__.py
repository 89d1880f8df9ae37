"""Patch ``npu_qwen3_vl_moe_routing``: its spec (``spec.PATCH``), its replacement code and its self-test."""
