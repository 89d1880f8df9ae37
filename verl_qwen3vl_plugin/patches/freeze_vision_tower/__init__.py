"""Patch ``freeze_vision_tower``: its spec (``spec.PATCH``), its replacement code and its self-test."""
