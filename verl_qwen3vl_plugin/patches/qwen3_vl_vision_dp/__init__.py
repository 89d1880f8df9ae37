"""Patch ``qwen3_vl_vision_dp``: its spec (``spec.PATCH``), its replacement code and its self-test."""
