"""Patch ``qwen3_vl_single_vision_call``: its spec (``spec.PATCH``), its replacement code and its self-test."""
