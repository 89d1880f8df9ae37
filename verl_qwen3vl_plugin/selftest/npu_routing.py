"""Checks of the ``npu_qwen3_vl_moe_routing`` patch: verl's real ``npu_patch`` on the CPU reference ``torch_npu``
ops, its Qwen3-VL-MoE block against transformers' block holding the same weights.

Importing verl's ``npu_patch`` rewires transformers for the rest of its process, so ``run()`` runs the checks in a
child process (``python -m verl_qwen3vl_plugin.selftest.npu_routing``).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import torch

from verl_qwen3vl_plugin.selftest import Check
from verl_qwen3vl_plugin.selftest.moe_blocks import BlockRun

TOLERANCE = 1e-5  # absolute and relative, per tensor: outputs, input gradients, parameter gradients


def block_check(name: str, actual: BlockRun, expected: BlockRun) -> Check:
    """Outputs, input gradients and every parameter gradient allclose within TOLERANCE."""
    pairs = {"output": (actual.out, expected.out), "input gradient": (actual.input_grad, expected.input_grad)}
    if actual.param_grads.keys() != expected.param_grads.keys():
        return Check(name, False, f"parameters differ: {sorted(actual.param_grads)} vs {sorted(expected.param_grads)}")
    pairs.update({f"{k} gradient": (actual.param_grads[k], g) for k, g in expected.param_grads.items()})
    bad = [k for k, (a, e) in pairs.items() if not torch.allclose(a, e, rtol=TOLERANCE, atol=TOLERANCE)]
    worst = max(float((a - e).abs().max()) for a, e in pairs.values())
    return Check(
        name, not bad, f"max |difference| {worst:.2e} (tolerance {TOLERANCE})" + (f"; off: {bad}" if bad else "")
    )


def checks_here() -> list[Check]:
    """The checks, in this process (which they leave with verl's npu_patch imported)."""
    from verl_qwen3vl_plugin.compat import dist_version, module_source
    from verl_qwen3vl_plugin.patches.npu_qwen3_vl_moe import BLOCK, PATCH, TARGET
    from verl_qwen3vl_plugin.registry import Verdict, decide, install_group
    from verl_qwen3vl_plugin.selftest.moe_blocks import block_input, block_pair, run_block
    from verl_qwen3vl_plugin.selftest.npu_reference import fake_torch_npu

    verdict, reason = decide(PATCH, PATCH.targets[0], module_source(TARGET))
    checks = [Check("npu routing decision", verdict is not Verdict.UNRECOGNIZED, f"{verdict.value}: {reason}")]
    if verdict not in (Verdict.APPLY, Verdict.FIXED_UPSTREAM):
        return checks
    with fake_torch_npu():
        from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe

        hf_cls = modeling_qwen3_vl_moe.Qwen3VLMoeTextSparseMoeBlock
        npu_cls = getattr(importlib.import_module(TARGET), BLOCK)
        verl_forward = npu_cls.forward
        install_group(PATCH.group)
        if dist_version("transformers").major >= 5:
            checks.append(Check("npu routing numerics", True, "not compared: verl's NPU block and transformers 5 "
                                "store experts in different layouts"))  # fmt: skip
            return checks
        hf, npu = block_pair(hf_cls, npu_cls, num_experts=4)
        if verdict is Verdict.APPLY:
            try:
                bug = block_check(
                    "", run_block(npu, block_input(), True, verl_forward), run_block(hf, block_input(), True)
                )
                reproduced, detail = not bug.ok, bug.detail
            except IndexError as exc:
                reproduced, detail = True, f"IndexError: {exc}"
            checks.append(Check("npu routing bug reproduced without the plugin (training)", reproduced, detail))
        for training in (True, False):
            mode = "training" if training else "eval"
            name = f"npu block vs transformers ({mode}): outputs and gradients"
            checks.append(
                block_check(name, run_block(npu, block_input(), training), run_block(hf, block_input(), training))
            )
    return checks


def run() -> list[Check]:
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"}
    # The child installs the hook itself, after keeping verl's forward.
    env.update(VERL_USE_EXTERNAL_PLUGINS="none", VERL_QWEN3VL_PLUGIN_AUTOLOAD="0")
    proc = subprocess.run([sys.executable, "-m", __name__], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return [Check("npu routing checks", False, f"child process failed: {proc.stderr.strip()[-2000:]}")]
    return [Check(*c) for c in json.loads(proc.stdout.strip().splitlines()[-1])]


if __name__ == "__main__":
    print(json.dumps([list(c) for c in checks_here()]))
