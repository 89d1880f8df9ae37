"""Targets of ``fused_kernels_sp_labels``: verl's forward module of each model line (``qwen3_vl``, ``qwen3_5``).

- ``ROLLS_ITS_INPUT`` (verl 0.7.x): ``forward_with_torch_backend`` and ``forward_with_triton_backend`` each take
  ``(self, input_ids, labels, ...)``, no ``shift_labels``, and roll ``labels`` or else ``input_ids`` by -1 themselves;
  and verl's actor (``dp_actor``, which the probe reads) hands a vision-language model the whole padded sequence
  under SP (``ulysses_pad``) and passes it no labels.
- ``TAKES_SHIFT_LABELS`` (verl >= 0.8): both forwards take ``shift_labels``, the engine's rolled and sliced labels
  (verl#6268).
"""

from __future__ import annotations

import ast
from types import ModuleType

from verl_qwen3vl_plugin import environment, originals, syntax
from verl_qwen3vl_plugin.families import QWEN3_5, QWEN3_VL, Family
from verl_qwen3vl_plugin.family_shapes import absent_in_verl
from verl_qwen3vl_plugin.registry import MODEL, Decision, Patch, Shape, Target, Verdict, unrecognized
from verl_qwen3vl_plugin.upstream import DP_ACTOR

FORWARDS = ("forward_with_torch_backend", "forward_with_triton_backend")

ROLLS_ITS_INPUT = Shape(id="verl0.7-fused-forwards-roll-their-input", verdict=Verdict.APPLY, verl="<0.8")
TAKES_SHIFT_LABELS = Shape(id="verl0.8-fused-forwards-take-shift-labels", verdict=Verdict.FIXED_UPSTREAM, verl=">=0.8")
NO_VERL_QWEN3_5 = absent_in_verl(QWEN3_5)


def _rolls(func: ast.FunctionDef, name: str) -> bool:
    """Whether ``func`` rolls ``name`` by -1 (``torch.roll(name, shifts=-1, ...)``)."""
    return any(
        c.args
        and ast.unparse(c.args[0]) == name
        and any(k.arg == "shifts" and ast.unparse(k.value) == "-1" for k in c.keywords)
        for c in syntax.call_nodes(func, "roll")
    )


def _actor_hands_whole_sequence() -> bool:
    """verl 0.7.x's actor: under SP a vision-language model gets the padded, unsliced ``input_ids_rmpad``, and no
    labels of any kind."""
    actor = syntax.find_class(environment.tree(DP_ACTOR), "DataParallelPPOActor")
    forward = syntax.find_function(actor, "_forward_micro_batch")
    if forward is None:
        return False
    pads = any(
        c.args and ast.unparse(c.args[0]) == "input_ids_rmpad" for c in syntax.call_nodes(forward, "ulysses_pad")
    )
    module_calls = [
        c for c in ast.walk(forward) if isinstance(c, ast.Call) and ast.unparse(c.func) == "self.actor_module"
    ]
    passes_labels = any(k.arg in ("labels", "shift_labels") for c in module_calls for k in c.keywords)
    return pads and bool(module_calls) and not passes_labels


def probe(tree: ast.Module, family: Family = QWEN3_VL) -> Decision:
    forwards = [syntax.find_function(tree, name) for name in FORWARDS]
    if any(f is None for f in forwards):
        return unrecognized(f"{family.verl_forward} lacks {' or '.join(FORWARDS)}")
    params = [syntax.parameters(f) + [a.arg for a in f.args.kwonlyargs] for f in forwards]
    if all("shift_labels" in p for p in params):
        return TAKES_SHIFT_LABELS.decision("the fused forwards take the engine's rolled, SP-sliced shift_labels")
    if (
        all(p[:3] == ["self", "input_ids", "labels"] for p in params)
        and all(_rolls(f, "labels") and _rolls(f, "input_ids") for f in forwards)
        and _actor_hands_whole_sequence()
    ):
        return ROLLS_ITS_INPUT.decision(
            "the fused forwards roll the whole sequence and score each SP rank's hidden states against the first "
            "shard's labels"
        )
    return unrecognized("the fused forwards' labels are not verl 0.7's or 0.8's")


def _apply(module: ModuleType, decision: Decision) -> None:
    from verl_qwen3vl_plugin.patches.fused_kernels_sp_labels.replacement import scoring_this_shard

    for name in FORWARDS:
        originals.wrap(module, name, scoring_this_shard)


DETAILS = """\
**Seen.** verl 0.7.1's real `DataParallelPPOActor._forward_micro_batch`, remove-padding and fused kernels (torch
backend), a tiny Qwen3-VL and Qwen3-VL-MoE on two FSDP2 ranks (gloo): SP = 2 against SP = 1 on the same micro-batch
(`tests/patches/fused_kernels_sp_labels/`). Without the patch every token rank 1 holds is scored against rank 0's
labels: the log-probs of the samples past the middle of the packed sequence differ by up to 0.51 (MoE 0.34), the
gradients by 2.7x (MoE 4.4x) relative. With it the log-probs are equal and the gradients within 5e-7. Without fused
kernels SP = 2 equals SP = 1 either way. Reported as verl#6068 (Qwen3-VL-8B GRPO: the reward regresses only with
fused kernels) and verl#3512 (abnormal KL); fixed in verl 0.8 by verl#6268 (`shift_labels`).

**Details of the change.** verl's own fused forwards still run: the wrapper computes this rank's labels (the whole
sequence rolled by one, then this rank's shard, what the actor computes for its unfused path) and hands them to
verl's forward rolled back by one, since that forward rolls its labels by one before scoring. With one SP rank
nothing changes. verl 0.7 has no Qwen3.5 forward, so only the Qwen3-VL line's module is patched.

**Upstream plan.** A backport of verl#6268 to the 0.7.x release branch: the actor passes `input_ids_rmpad_rolled` as
`shift_labels` on the fused path, and the fused forwards take it. PR title: `[model] fix: score fused-kernel log-probs
against the SP shard's labels under Ulysses`.
"""

PATCH = Patch(
    name="fused_kernels_sp_labels",
    title="verl 0.7.x's fused kernels under Ulysses SP score each shard against its own labels",
    group=MODEL,
    targets=(
        Target(
            module=QWEN3_VL.verl_forward,
            probe=probe,
            apply=_apply,
            reads=(DP_ACTOR,),
            shapes=(ROLLS_ITS_INPUT, TAKES_SHIFT_LABELS),
        ),
        Target(
            module=QWEN3_5.verl_forward,
            probe=lambda tree: probe(tree, QWEN3_5),
            apply=_apply,
            absent=NO_VERL_QWEN3_5.when_absent(QWEN3_5.missing("verl")),
            reads=(DP_ACTOR,),
            shapes=(NO_VERL_QWEN3_5, TAKES_SHIFT_LABELS),
        ),
    ),
    why=(
        "With use_fused_kernels and Ulysses SP, verl 0.7.x's Qwen3-VL forward scores every SP rank's tokens against "
        "the labels of the first rank's shard: log-probs and gradients are wrong past the first shard (rewards "
        "regress only with fused kernels)."
    ),
    how=(
        "verl's fused forwards are given this rank's labels: the whole sequence rolled by one and sliced to the "
        "rank's shard, as the actor's unfused path computes them."
    ),
    upstream=("verl#6068", "verl#3512", "verl#5227", "verl#6268"),
    remove_when="verl 0.7.x is not among the verl releases you run (0.8 passes shift_labels).",
    details=DETAILS,
)
