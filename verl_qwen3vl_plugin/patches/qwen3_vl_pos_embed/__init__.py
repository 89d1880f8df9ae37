"""Patch ``qwen3_vl_pos_embed``: its spec (``spec.PATCH``), its replacement code and its self-test."""
