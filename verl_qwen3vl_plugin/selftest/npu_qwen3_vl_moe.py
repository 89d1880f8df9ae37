"""Checks of the NPU Qwen3-VL-MoE patches (routing, weight sync): verl's real ``npu_patch`` on the CPU reference
``torch_npu`` ops, its block against transformers' block holding the same weights, and what verl's FSDP engine
streams to the rollout against what it streams for transformers' own model.

Importing verl's ``npu_patch`` rewires transformers for the rest of its process, so ``run()`` runs the checks in a
child process (``python -m verl_qwen3vl_plugin.selftest.npu_qwen3_vl_moe``).
"""

from __future__ import annotations

import importlib
import json

import torch

from verl_qwen3vl_plugin.selftest import Check, in_child, installed_decision
from verl_qwen3vl_plugin.selftest.moe_blocks import BlockRun

TOLERANCE = 1e-5  # absolute and relative, per tensor: outputs, input gradients, parameter gradients


def block_check(name: str, actual: BlockRun, expected: BlockRun) -> Check:
    """Outputs, input gradients and every parameter gradient allclose within TOLERANCE."""
    pairs = {"output": (actual.out, expected.out), "input gradient": (actual.input_grad, expected.input_grad)}
    if actual.param_grads.keys() != expected.param_grads.keys():
        return Check(name, False, f"parameters differ: {sorted(actual.param_grads)} vs {sorted(expected.param_grads)}")
    pairs.update({f"{k} gradient": (actual.param_grads[k], g) for k, g in expected.param_grads.items()})
    bad = [k for k, (a, e) in pairs.items() if a.shape != e.shape or not torch.allclose(a, e, TOLERANCE, TOLERANCE)]
    worst = max(float((a - e).abs().max()) if a.shape == e.shape else float("inf") for a, e in pairs.values())
    return Check(
        name, not bad, f"max |difference| {worst:.2e} (tolerance {TOLERANCE})" + (f"; off: {bad}" if bad else "")
    )


def weight_sync_check(name: str, actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> Check:
    """The same keys, and every tensor ``torch.equal``: the rollout must receive exactly transformers' experts."""
    if actual.keys() != expected.keys():
        return Check(name, False, f"keys differ: {sorted(actual.keys() ^ expected.keys())[:4]}")
    bad = [k for k, t in expected.items() if actual[k].shape != t.shape or not torch.equal(actual[k], t)]
    shapes = [f"{k}: {tuple(actual[k].shape)} vs {tuple(expected[k].shape)}" for k in bad[:2]]
    return Check(name, not bad, f"{len(bad)} of {len(expected)} tensors differ {shapes}" if bad else "all equal")


def _with_experts_forward(experts_forward):
    """A block forward that runs the block with its experts' class forward set to ``experts_forward``."""

    def forward(block, x):
        cls = type(block.experts)
        kept, cls.forward = cls.forward, experts_forward
        try:
            return block(x)
        finally:
            cls.forward = kept

    return forward


def checks_here() -> list[Check]:
    """The checks, in this process (which they leave with verl's npu_patch imported)."""
    from verl_qwen3vl_plugin.hooks import install
    from verl_qwen3vl_plugin.patches import PATCHES
    from verl_qwen3vl_plugin.patches import npu_qwen3_vl_moe_routing as routing
    from verl_qwen3vl_plugin.patches import npu_qwen3_vl_moe_sparse_eval as sparse_eval
    from verl_qwen3vl_plugin.patches import npu_qwen3_vl_moe_weight_sync as sync
    from verl_qwen3vl_plugin.registry import NPU, Verdict
    from verl_qwen3vl_plugin.selftest.moe_blocks import (
        block_input,
        block_pair,
        engine_weight_stream,
        npu_layout,
        run_block,
    )
    from verl_qwen3vl_plugin.selftest.npu_reference import fake_torch_npu
    from verl_qwen3vl_plugin.selftest.tiny_models import randomize, tiny_qwen3_vl_moe

    verdicts, checks = {}, []
    for patch in (p for p in PATCHES if p.selftest == __spec__.name):  # the patches whose checks live here
        decision = installed_decision(patch, patch.targets[0])
        verdict, reason = decision.verdict, decision.reason
        verdicts[patch.name] = verdict
        checks.append(
            Check(f"{patch.name} decision", verdict is not Verdict.UNRECOGNIZED, f"{verdict.value}: {reason}")
        )
    if verdicts[routing.PATCH.name] not in (Verdict.APPLY, Verdict.FIXED_UPSTREAM):
        return checks
    with fake_torch_npu():
        from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe

        hf_cls = modeling_qwen3_vl_moe.Qwen3VLMoeTextSparseMoeBlock
        reference = randomize(tiny_qwen3_vl_moe(), seed=0)  # transformers' own model, before verl swaps the block
        syncs = verdicts[sync.PATCH.name] is Verdict.APPLY
        expected_stream = engine_weight_stream(reference) if syncs else None  # verl's own code, transformers' layout
        npu_patch = importlib.import_module(routing.TARGET)
        getattr(npu_patch, "apply_npu_patches", lambda: None)()  # verl >= 0.9 swaps the block here, 0.8 at import
        npu_cls = getattr(npu_patch, routing.BLOCK)
        experts_cls = getattr(npu_patch, sparse_eval.EXPERTS)
        verl_forward, verl_experts_forward = npu_cls.forward, experts_cls.forward
        install(NPU)
        hf, npu = block_pair(hf_cls, npu_cls, num_experts=4)
        if verdicts[routing.PATCH.name] is Verdict.APPLY:
            try:
                bug = block_check(
                    "", run_block(npu, block_input(), True, verl_forward), run_block(hf, block_input(), True)
                )
                reproduced, detail = not bug.ok, bug.detail
            except IndexError as exc:
                reproduced, detail = True, f"IndexError: {exc}"
            checks.append(Check("npu routing bug reproduced without the plugin (training)", reproduced, detail))
        runs = {training: run_block(npu, block_input(), training) for training in (True, False)}
        for training, run in runs.items():
            mode = "training" if training else "eval"
            checks.append(block_check(f"npu block vs transformers ({mode}): outputs and gradients", run,
                                      run_block(hf, block_input(), training)))  # fmt: skip
        if verdicts[sparse_eval.PATCH.name] is Verdict.APPLY:
            dense = run_block(npu, block_input(), False, forward=_with_experts_forward(verl_experts_forward))
            checks.append(block_check("npu grouped eval vs verl's dense eval", runs[False], dense))
            same = torch.equal(runs[False].out, runs[True].out)
            checks.append(Check("npu eval output == training output", same, "bit-identical" if same else "differ"))
        if syncs:
            model = tiny_qwen3_vl_moe()
            model.load_state_dict(npu_layout(reference.state_dict()))
            checks.append(weight_sync_check("npu weight sync vs transformers' model: per-expert tensors",
                                            engine_weight_stream(model), expected_stream))  # fmt: skip
    return checks


def run() -> list[Check]:
    return in_child(__name__, "npu checks")  # the child keeps verl's own functions before it installs the hooks


if __name__ == "__main__":
    print(json.dumps([list(c) for c in checks_here()]))
