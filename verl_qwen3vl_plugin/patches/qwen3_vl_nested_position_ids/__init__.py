"""Patch ``qwen3_vl_nested_position_ids``: its spec (``spec.PATCH``), its replacement code and its self-test."""
