"""Patch ``qwen3_5_layer_attributes``: its spec (``spec.PATCH``), its replacement code and its self-test."""
