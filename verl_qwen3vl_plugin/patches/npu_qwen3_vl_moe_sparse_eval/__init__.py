"""Patch ``npu_qwen3_vl_moe_sparse_eval``: its spec (``spec.PATCH``), its replacement code and its self-test."""
