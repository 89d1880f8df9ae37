"""Test-only shims for the end-to-end run on a CPU machine: each says what it replaces and why. See
``tests/e2e/README.md``."""
