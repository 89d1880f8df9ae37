"""Test fixtures that ship with the plugin so ``verl-qwen3vl-plugin doctor --selftest`` can run them anywhere.

Never used in training: tiny random models built from configs, and CPU reference versions of the Ascend ops verl's
NPU path calls.
"""
