"""Targets of ``qwen3_vl_vision_dp``: transformers' four modeling modules, where the vision class's ``forward`` is
wrapped. Each decision reads two sources, since the patch is right only where both hold. The wrapper does nothing
until verl sets a Ulysses group of more than one rank.

- ``SLICES_AFTER_TOWER``, verl's side, which the self-test also reads: ``apply_monkey_patch`` calls
  ``patch_vlm_for_ulysses_input_slicing`` in a call that names the family's line, so verl slices the inputs at the
  language model's entry and every rank of the group holds every image.
- ``TOWER_ON_EVERY_RANK``: that, and the vision ``forward(self, hidden_states, grid_thw, **kwargs)`` returns, for
  Qwen3-VL, a 2-tuple or ``BaseModelOutputWithDeepstackFeatures(...)``, for Qwen3.5 (no deepstack),
  ``BaseModelOutputWithPooling(...)``.
"""

from __future__ import annotations

import ast

from verl_qwen3vl_plugin import environment, originals, syntax, vision_towers
from verl_qwen3vl_plugin.families import QWEN3_VL, Family
from verl_qwen3vl_plugin.registry import MODEL, Decision, Patch, Shape, Verdict, unrecognized
from verl_qwen3vl_plugin.upstream import MONKEY_PATCH

SIGNATURE = ["self", "hidden_states", "grid_thw"]
DEEPSTACK_OUTPUT, POOLING_OUTPUT = "BaseModelOutputWithDeepstackFeatures", "BaseModelOutputWithPooling"
VERL_SLICER = "patch_vlm_for_ulysses_input_slicing"


def _returns_known_output(forward: ast.FunctionDef, family: Family) -> bool:
    """Qwen3-VL: the (embeddings, deepstack) pair or the deepstack output; Qwen3.5: the pooling output."""
    deepstack = family.line == QWEN3_VL.line
    for node in ast.walk(forward):
        if isinstance(node, ast.Return) and node.value is not None:
            value = node.value
            if deepstack and isinstance(value, ast.Tuple) and len(value.elts) == 2:
                return True
            if isinstance(value, ast.Call) and syntax.calls(value, DEEPSTACK_OUTPUT if deepstack else POOLING_OUTPUT):
                return True
    return False


# The premise, verl's side (its own probe: the self-test reads it), and the tower's shape where it holds.
SLICES_AFTER_TOWER = Shape(id="slices-after-tower", verdict=Verdict.APPLY)
TOWER_ON_EVERY_RANK = Shape(id="tower-on-every-rank/slices-after-tower", verdict=Verdict.APPLY)


def probe_verl(tree: ast.Module | None, family: Family = QWEN3_VL) -> Decision:
    """Whether verl runs ``family``'s vision tower before it slices the sequence: the premise of the whole patch."""
    func = syntax.find_function(tree, "apply_monkey_patch") if tree is not None else None
    if func is None:
        return unrecognized(f"no apply_monkey_patch in {MONKEY_PATCH}")
    slices = any(
        isinstance(node, ast.Call) and syntax.calls(node, VERL_SLICER) and syntax.mentions(node, family.line_prefix)
        for node in ast.walk(func)
    )
    if slices:
        return SLICES_AFTER_TOWER.decision(f"verl slices {family.line} inputs after the vision tower ({VERL_SLICER})")
    return unrecognized(f"verl's apply_monkey_patch does not call {VERL_SLICER} for {family.line}")


def probe_vision_class(family: Family, tree: ast.Module) -> Decision:
    cls_name = family.vision_class
    forward = syntax.find_function(syntax.find_class(tree, cls_name), "forward")
    if forward is None:
        return unrecognized(f"no {cls_name}.forward in this transformers")
    if syntax.parameters(forward) != SIGNATURE or forward.args.kwarg is None:
        return unrecognized(f"{cls_name}.forward is not (self, hidden_states, grid_thw, **kwargs)")
    if not _returns_known_output(forward, family):
        known = f"a pair or {DEEPSTACK_OUTPUT}" if family.line == QWEN3_VL.line else POOLING_OUTPUT
        return unrecognized(f"{cls_name}.forward does not return {known}")
    verl = probe_verl(environment.tree(MONKEY_PATCH), family)
    if verl.verdict is not Verdict.APPLY:
        return verl
    reason = f"{cls_name} runs every image on every Ulysses rank; {verl.reason}; acts when SP > 1"
    return TOWER_ON_EVERY_RANK.decision(reason)


def _apply_to_vision_class(cls: type) -> None:
    from verl_qwen3vl_plugin.patches.qwen3_vl_vision_dp.replacement import beside_verl_vision_dp

    originals.wrap(cls, "forward", beside_verl_vision_dp)


DETAILS = """\
**Cost.** For Qwen3-VL-30B-A3B the tower costs about 1 GFLOP per patch, and the language model about 6.6 GFLOP per
text token, which SP divides. At the recipe's SP 8 a rank's share of a sample with P patches and T tokens is P GFLOP
of vision against 0.83 T of text. Per-rank work and measured times are in `docs/performance.md`.

**Details of the change.** The merged embeddings and the deepstack features travel in one all-gather, concatenated
along the feature axis and padded to the largest run. On transformers 5 the returned output carries the gathered
`pooler_output` (and, for Qwen3-VL, `deepstack_features`). Its `last_hidden_state` (unmerged patches, this rank's
only) is None rather than partial, since neither verl nor transformers' Qwen3-VL reads it. The wrapper calls upstream
unchanged outside a Ulysses group, on a class that verl#5230's own vision DP has wrapped, and when the forward gets
extra keyword arguments (transformers 5 can pass precomputed per-image tables, which a share cannot be cut from).
That last fallback logs a WARNING once per process. Each split logs this rank's share at DEBUG. Without the agreement
step, ranks holding different images would split different lists without a word: the negative control in
`tests/patches/qwen3_vl_vision_dp/test_probes.py` shows it.

**Tests.** `tests/patches/qwen3_vl_vision_dp/test_ulysses.py` runs verl's real Ulysses path (verl 0.7's actor, the
FSDP engine from 0.8) on two gloo ranks, SP = 2 with the plugin against SP = 1. Each rank's tower sees only its share,
and log-probs, entropies and gradients match, for Qwen3-VL, Qwen3-VL-MoE (also under FSDP2), Qwen3.5 and
Qwen3.5-MoE. The Qwen3.5 models' gated delta-net layers run under Ulysses through `qwen3_5_packed_delta_net`.

**Upstream plan.** verl#5230 ("Vision DP": whole images per rank, patch-balanced contiguous runs, an all-gather whose
backward all-reduces) is the open proposal this follows. The plugin adds the check that every rank holds the same
images. NVIDIA NeMo Automodel's merged frame-level sharding (PR #2990) gathers deepstack features too. The change
belongs in `verl/models/transformers/monkey_patch.py`, wrapping the vision forward where
`patch_vlm_for_ulysses_input_slicing` is applied. Review verl#5230 with that check in mind, or send
`[model, fsdp] feat: split Qwen3-VL vision towers over the Ulysses group`, its tests in a `*_on_cpu.py` file beside
verl's model tests.
"""

PATCH = Patch(
    name="qwen3_vl_vision_dp",
    title="the vision tower split over the Ulysses group",
    group=MODEL,
    targets=vision_towers.vision_targets(
        probe_vision_class, _apply_to_vision_class, (TOWER_ON_EVERY_RANK,), reads=(MONKEY_PATCH,)
    ),
    why=(
        "With Ulysses sequence parallelism verl slices a VLM's sequence only at the language model, after the "
        "vision tower: every rank of the SP group runs the tower on every image of the micro-batch, forward and "
        "backward, and holds its activations. At SP 8 that is 8 times the vision work."
    ),
    how=(
        "verl_qwen3vl_plugin.patches.qwen3_vl_vision_dp.replacement.vision_dp_forward"
        " wraps the vision forward: contiguous runs of whole "
        "images, balanced by patch count, one per rank (a one-token dummy for a rank without one); embeddings (and "
        "Qwen3-VL's deepstack features) all-gathered back in order; their backward sums over the group."
    ),
    upstream=("verl#5230",),
    remove_when="verl shards the vision tower over the Ulysses group itself (verl#5230 or a successor) in the "
    "oldest verl you run.",
    details=DETAILS,
)
