"""Patch ``dp_actor_dynamic_batch_sync``: its spec (``spec.PATCH``), its replacement code and its self-test."""
