"""The checks of the three NPU Qwen3-VL-MoE patches, made in one child process that each patch's self-test module
(``npu_qwen3_vl_moe_routing``, ``..._sparse_eval``, ``..._weight_sync``) takes its own checks from: verl's real
``npu_patch`` on the CPU reference ``torch_npu`` ops, its block against transformers' block holding the same weights,
and what verl's FSDP engine streams to the rollout against what it streams for transformers' own model.

Why a child process: verl's ``npu_patch`` imports ``torch_npu``, so on the CPU the reference ops must be installed
as ``torch_npu`` before it is imported, and importing it swaps transformers' Qwen3-VL-MoE block for the rest of its
process; the weight-sync reference (transformers' own model, streamed by verl's engine) must be built in that
process before the swap.

Why one child for the three patches, not one each: they are one hook group, ``watch_group(NPU)`` installs all three
(two patch the same ``npu_patch`` module), so a child of one patch would set up, import and patch exactly what the
others' do, and the doctor would pay that (seconds: verl, transformers and a tiny model) three times; and the checks
build on one another: the sparse-eval checks compare the routing-fixed block's eval run with its training run. So
the child makes every check once per process (``child_checks``) and each patch's ``run()`` keeps its own by name
(``OWNED``); a child that fails is one failed check for each patch.
"""

from __future__ import annotations

import functools
import importlib
import json

import torch

from verl_qwen3vl_plugin.selftest import Check, in_child
from verl_qwen3vl_plugin.selftest.moe_blocks import BlockRun

TOLERANCE = 1e-5  # absolute and relative, per tensor: outputs, input gradients, parameter gradients
CHILD = "npu checks"  # the one check of a child that failed
BUG = "npu routing bug reproduced without the plugin (training)"
BLOCK = "npu block vs transformers ({}): outputs and gradients"
DENSE_EVAL = "npu grouped eval vs verl's dense eval"
SAME_OUTPUT = "npu eval output == training output"
WEIGHT_SYNC = "npu weight sync vs transformers' model: per-expert tensors"
# Per patch, the checks of its own code besides its "<patch> decision": the routing fix acts in training, the sparse
# eval in eval, the weight sync on the engine's stream.
OWNED = {
    "npu_qwen3_vl_moe_routing": (BUG, BLOCK.format("training")),
    "npu_qwen3_vl_moe_sparse_eval": (BLOCK.format("eval"), DENSE_EVAL, SAME_OUTPUT),
    "npu_qwen3_vl_moe_weight_sync": (WEIGHT_SYNC,),
}


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
    """Every NPU patch's checks, in this process (which they leave with verl's npu_patch imported)."""
    from verl_qwen3vl_plugin.hooks import watch_group
    from verl_qwen3vl_plugin.patches.npu_qwen3_vl_moe_routing import spec as routing
    from verl_qwen3vl_plugin.patches.npu_qwen3_vl_moe_sparse_eval import spec as sparse_eval
    from verl_qwen3vl_plugin.patches.npu_qwen3_vl_moe_weight_sync import spec as sync
    from verl_qwen3vl_plugin.registry import NPU, Verdict, decide_installed
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
    for patch in (routing.PATCH, sparse_eval.PATCH, sync.PATCH):
        decision = decide_installed(patch, patch.targets[0])
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
        npu_patch = importlib.import_module(routing.PATCH.targets[0].module)
        getattr(npu_patch, "apply_npu_patches", lambda: None)()  # verl >= 0.9 swaps the block here, 0.8 at import
        npu_cls = getattr(npu_patch, routing.BLOCK)
        experts_cls = getattr(npu_patch, sparse_eval.EXPERTS)
        verl_forward, verl_experts_forward = npu_cls.forward, experts_cls.forward
        watch_group(NPU)
        hf, npu = block_pair(hf_cls, npu_cls, num_experts=4)
        if verdicts[routing.PATCH.name] is Verdict.APPLY:
            try:
                bug = block_check(
                    "", run_block(npu, block_input(), True, verl_forward), run_block(hf, block_input(), True)
                )
                reproduced, detail = not bug.ok, bug.detail
            except IndexError as exc:
                reproduced, detail = True, f"IndexError: {exc}"
            checks.append(Check(BUG, reproduced, detail))
        runs = {training: run_block(npu, block_input(), training) for training in (True, False)}
        for training, run in runs.items():
            mode = "training" if training else "eval"
            checks.append(block_check(BLOCK.format(mode), run, run_block(hf, block_input(), training)))
        if verdicts[sparse_eval.PATCH.name] is Verdict.APPLY:
            dense = run_block(npu, block_input(), False, forward=_with_experts_forward(verl_experts_forward))
            checks.append(block_check(DENSE_EVAL, runs[False], dense))
            same = torch.equal(runs[False].out, runs[True].out)
            checks.append(Check(SAME_OUTPUT, same, "bit-identical" if same else "differ"))
        if syncs:
            model = tiny_qwen3_vl_moe()
            model.load_state_dict(npu_layout(reference.state_dict()))
            checks.append(weight_sync_check(WEIGHT_SYNC, engine_weight_stream(model), expected_stream))
    return checks


@functools.cache
def child_checks() -> tuple[Check, ...]:
    """``checks_here()`` in a child process, once per process: the three patches' self-tests share it."""
    try:
        return tuple(in_child(__name__, CHILD))  # the child keeps verl's own functions before it installs the hooks
    except Exception as exc:  # kept too: a child that timed out is not started again for the next patch
        return (Check(CHILD, False, f"{type(exc).__name__}: {exc}"),)


def checks_of(patch: str) -> list[Check]:
    """``patch``'s checks among the shared child's: its decision and its ``OWNED`` checks, or the child's failure."""
    own = {f"{patch} decision", *OWNED[patch], CHILD}
    return [check for check in child_checks() if check.name in own]


if __name__ == "__main__":
    print(json.dumps([list(c) for c in checks_here()]))
