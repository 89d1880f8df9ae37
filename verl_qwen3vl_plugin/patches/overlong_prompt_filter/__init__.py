"""Patch ``overlong_prompt_filter``: its spec (``spec.PATCH``), its replacement code and its self-test."""
