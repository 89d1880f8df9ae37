"""Patch ``qwen3_5_packed_delta_net``: its spec (``spec.PATCH``), its replacement code and its self-test."""
