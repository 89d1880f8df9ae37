"""Self-test of ``npu_qwen3_vl_moe_routing``: its decision, verl's routing bug reproduced without the plugin, and
verl's NPU block against transformers' in training; taken from the NPU patches' shared child process
(``npu_qwen3_vl_moe`` says why the three share one)."""

from __future__ import annotations

from verl_qwen3vl_plugin.selftest import Check
from verl_qwen3vl_plugin.selftest.npu_qwen3_vl_moe import checks_of


def run() -> list[Check]:
    return checks_of("npu_qwen3_vl_moe_routing")
