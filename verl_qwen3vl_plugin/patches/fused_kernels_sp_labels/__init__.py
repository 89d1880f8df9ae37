"""Patch ``fused_kernels_sp_labels``: its spec (``spec.PATCH``), its replacement code and its self-test."""
