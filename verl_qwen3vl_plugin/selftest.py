"""``verl-qwen3vl-plugin doctor --selftest``: both patches run on embedded tiny models on the CPU and are compared
with the reference implementations installed here. Takes seconds; needs no accelerator and no download.

The NPU check imports verl's real ``npu_patch`` on the CPU reference ``torch_npu`` ops. That import rewires
transformers for the rest of its process, so it runs in a child process (``python -m verl_qwen3vl_plugin.selftest``).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from verl_qwen3vl_plugin.compat import dist_version, method_calls
from verl_qwen3vl_plugin.registry import Status

GRIDS = [[1, 2, 2], [1, 38, 50], [3, 8, 8], [1, 2, 64], [16, 32, 32]]
TOLERANCE = 1e-5


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def pos_embed_references() -> dict[str, Callable]:
    """Upstream interpolations installed here: transformers' own (where its forward calls it) and verl's fix."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    from verl_qwen3vl_plugin.patches.qwen3_vl_pos_embed import METHOD, upstream_method

    references = {}
    if method_calls(Qwen3VLVisionModel, "forward", METHOD):
        references["transformers"] = upstream_method(Qwen3VLVisionModel)
    try:
        from verl.models.transformers.qwen3_vl import fast_pos_embed_interpolate as verl_version
    except ImportError:  # verl < 0.8 has no fixed copy
        pass
    else:
        references["verl"] = verl_version
    return references


def check_pos_embed() -> list[Check]:
    from verl_qwen3vl_plugin.models.qwen3_vl import fast_pos_embed_interpolate
    from verl_qwen3vl_plugin.testing.tiny_models import vision_tower

    grid = torch.tensor(GRIDS)
    checks = []
    for name, reference in pos_embed_references().items():
        for dtype in (torch.float32, torch.bfloat16):
            tower = vision_tower(dtype=dtype)
            same = torch.equal(fast_pos_embed_interpolate(tower, grid), reference(tower, grid))
            checks.append(Check(f"pos_embed {dtype} vs {name}", same, "bit-identical" if same else "outputs differ"))
        grads = []
        for fn in (fast_pos_embed_interpolate, reference):
            tower = vision_tower()
            fn(tower, grid).square().sum().backward()
            grads.append(tower.pos_embed.weight.grad)
        diff = float((grads[0] - grads[1]).abs().max() / grads[1].abs().max())
        checks.append(Check(f"pos_embed fp32 gradient vs {name}", diff <= 1e-6, f"max relative difference {diff:.1e}"))
    try:
        fast_pos_embed_interpolate(vision_tower(), torch.tensor([[1, 3, 4]]))
        checks.append(Check("pos_embed rejects an odd grid", False, "no error raised"))
    except ValueError as exc:
        checks.append(Check("pos_embed rejects an odd grid", True, str(exc)))
    return checks


def _max_difference(actual, expected) -> float:
    pairs = [(actual.out, expected.out), (actual.input_grad, expected.input_grad)]
    pairs += [(actual.param_grads[k], g) for k, g in expected.param_grads.items()]
    return max(float((a - b).abs().max()) for a, b in pairs)


def npu_checks_here() -> list[Check]:
    """The NPU routing checks, in this process (which they leave with verl's npu_patch imported)."""
    from verl_qwen3vl_plugin.patches import npu_qwen3_vl_moe as patch
    from verl_qwen3vl_plugin.testing.moe_blocks import block_input, block_pair, run_block
    from verl_qwen3vl_plugin.testing.npu_reference import fake_torch_npu

    status, reason = patch.decide_installed()
    checks = [Check("npu routing decision", status is not Status.FAILED, f"{status.value}: {reason}")]
    if status not in (Status.APPLIED, Status.FIXED_UPSTREAM):
        return checks
    with fake_torch_npu():
        from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe

        hf_cls = modeling_qwen3_vl_moe.Qwen3VLMoeTextSparseMoeBlock
        npu_cls = getattr(importlib.import_module(patch.TARGET), patch.BLOCK)
        verl_forward = npu_cls.forward
        patch.install()
        if dist_version("transformers").major >= 5:
            checks.append(Check("npu routing numerics", True, "not compared: verl's NPU block and transformers 5 "
                                "store experts in different layouts"))  # fmt: skip
            return checks
        hf, npu = block_pair(hf_cls, npu_cls, num_experts=4)
        if status is Status.APPLIED:
            try:
                diff = _max_difference(
                    run_block(npu, block_input(), True, verl_forward), run_block(hf, block_input(), True)
                )
                bug = f"max |difference| {diff:.2e} from transformers"
                reproduced = diff > TOLERANCE
            except IndexError as exc:
                bug, reproduced = f"IndexError: {exc}", True
            checks.append(Check("npu routing bug reproduced without the plugin (training)", reproduced, bug))
        for training in (True, False):
            mode = "training" if training else "eval"
            diff = _max_difference(run_block(npu, block_input(), training), run_block(hf, block_input(), training))
            checks.append(
                Check(f"npu block vs transformers ({mode}): outputs and gradients", diff <= TOLERANCE,
                      f"max |difference| {diff:.2e} (tolerance {TOLERANCE})")
            )  # fmt: skip
    return checks


def check_npu_routing() -> list[Check]:
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"}
    env["VERL_USE_EXTERNAL_PLUGINS"] = "none"  # the child installs the hook itself, after keeping verl's forward
    proc = subprocess.run(
        [sys.executable, "-m", "verl_qwen3vl_plugin.selftest"], env=env, capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        return [Check("npu routing checks", False, f"child process failed: {proc.stderr.strip()[-2000:]}")]
    return [Check(**c) for c in json.loads(proc.stdout.strip().splitlines()[-1])]


def run() -> list[Check]:
    return check_pos_embed() + check_npu_routing()


if __name__ == "__main__":
    print(json.dumps([dataclasses.asdict(c) for c in npu_checks_here()]))
