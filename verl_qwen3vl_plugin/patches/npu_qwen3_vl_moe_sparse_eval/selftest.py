"""Self-test of ``npu_qwen3_vl_moe_sparse_eval``: its decision, verl's NPU block against transformers' in eval, the
grouped eval against verl's dense one, and eval output bit-identical to training's; taken from the NPU patches'
shared child process (``npu_qwen3_vl_moe`` says why the three share one)."""

from __future__ import annotations

from verl_qwen3vl_plugin.selftest import Check
from verl_qwen3vl_plugin.selftest.npu_qwen3_vl_moe import checks_of


def run() -> list[Check]:
    return checks_of("npu_qwen3_vl_moe_sparse_eval")
