"""Patch ``vision_placeholder_ban``: its spec (``spec.PATCH``), its replacement code and its self-test."""
