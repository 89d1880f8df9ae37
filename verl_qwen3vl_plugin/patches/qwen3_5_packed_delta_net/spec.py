"""Targets of ``qwen3_5_packed_delta_net``: verl's ``qwen3_5`` module, whose ``qwen3_5_gated_delta_net_forward``
``apply_monkey_patch`` imports by name and installs on both Qwen3.5 layer classes, so the module's name is wrapped;
and transformers' ``modeling_qwen3_5`` and ``modeling_qwen3_5_moe``, for a verl that leaves their layers in place:
``<Family>GatedDeltaNet.forward`` is wrapped, and ``<Family>DecoderLayer.forward`` to read the boundaries from the
packed position ids.

On verl's module, the three shapes of its delta-net forward share
``qwen3_5_gated_delta_net_forward(self, hidden_states, cache_params, attention_mask, cu_seqlens, cu_seqlens_cpu)``,
which calls ``_packed_chunk_gated_delta_rule``, which asks ``_call_accepts_kwarg`` about ``"cu_seqlens"``.

- ``FLA_KEEPS_SAMPLES_APART``: that, where FLA is in use by transformers' own condition (``fla_in_use``).
- ``FALLBACK_IGNORES_BOUNDARIES``: that, without FLA, where transformers' ``torch_chunk_gated_delta_rule`` takes
  ``**kwargs``: verl's check passes and the rule ignores the boundaries.
- ``PER_SAMPLE_LOOP``: that, without FLA, where the torch rule takes no ``**kwargs``: verl loops over the samples.
- ``NO_DELTA_NET_FORWARD``: no ``qwen3_5_gated_delta_net_forward`` but a ``qwen3_5_base_forward``: transformers'
  layers run, judged on their own targets.
- ``NO_VERL_QWEN3_5``, on every target: verl has no ``qwen3_5`` module.

On transformers' modules:

- ``REPLACES_LAYER_FORWARD``: verl's module defines ``qwen3_5_gated_delta_net_forward`` and its ``monkey_patch``
  names it: verl's target acts.
- ``NO_BOUNDARIES``: ``<Family>GatedDeltaNet.forward(self, hidden_states, cache_params, ...)``, and a
  ``<Family>DecoderLayer.forward`` that takes ``position_ids`` and calls ``self.linear_attn(hidden_states=..., ...)``
  once, with no ``cu_seqlens``, ``cu_seq_lens_q`` or ``seq_idx``.
"""

from __future__ import annotations

import ast
import importlib.util
from types import ModuleType

from verl_qwen3vl_plugin import environment, originals, syntax
from verl_qwen3vl_plugin.families import QWEN3_5, QWEN3_5_MOE, Family
from verl_qwen3vl_plugin.family_shapes import absent_family, absent_in_verl, shipped, verl_forward_tree
from verl_qwen3vl_plugin.patches.qwen3_5_layer_attributes.spec import DISPATCHER
from verl_qwen3vl_plugin.registry import MODEL, Decision, Patch, Shape, Target, Verdict, unrecognized
from verl_qwen3vl_plugin.upstream import MONKEY_PATCH

FUNCTION = "qwen3_5_gated_delta_net_forward"  # in verl's Qwen3.5 forward module; apply_monkey_patch installs it
PARAMETERS = ["self", "hidden_states", "cache_params", "attention_mask", "cu_seqlens", "cu_seqlens_cpu"]
# The families with gated delta-net layers
FAMILIES = (QWEN3_5, QWEN3_5_MOE)
FALLBACK = "torch_chunk_gated_delta_rule"


NO_DELTA_NET_FORWARD = Shape(id="verl0.8-no-delta-net-forward", verdict=Verdict.NOT_USED, verl=">=0.8,<0.9")
FLA_KEEPS_SAMPLES_APART = Shape(
    id="verl0.9-fla-keeps-samples-apart",
    verdict=Verdict.FIXED_UPSTREAM,
    elsewhere="verl >= 0.9 with FLA in use (installed, on CUDA; on any device with transformers >= 5.16)",
)
NO_VERL_QWEN3_5 = absent_in_verl(QWEN3_5)
FALLBACK_IGNORES_BOUNDARIES = Shape(
    id="verl0.9-tf5.9-fallback-ignores-boundaries", verdict=Verdict.APPLY, verl=">=0.9", transformers=">=5.9"
)
PER_SAMPLE_LOOP = Shape(id="verl0.9-per-sample-loop", verdict=Verdict.APPLY, verl=">=0.9", transformers="<5.9")
REPLACES_LAYER_FORWARD = Shape(id="verl-replaces-layer-forward", verdict=Verdict.NOT_USED, verl=">=0.9")
NO_BOUNDARIES = Shape(id="verl0.8-no-boundaries", verdict=Verdict.APPLY, verl=">=0.8,<0.9")


def fla_in_use() -> bool:
    """transformers' own condition for FLA's kernels in these layers: FLA installed and CUDA available, or FLA
    installed at all where transformers (>= 5.16) picks the kernel at import, on any device."""
    if importlib.util.find_spec("fla") is None:
        return False
    return syntax.called_decorator(_fallback(), DISPATCHER) or environment.devices()["cuda"]


def _fallback() -> ast.FunctionDef | None:
    """transformers' torch chunked rule, as installed."""
    return syntax.find_function(environment.tree(QWEN3_5.modeling), FALLBACK)


def _fallback_takes_kwargs() -> bool | None:
    """Whether transformers' torch chunked rule takes ``**kwargs`` (>= 5.9: verl's ``cu_seqlens`` check passes and
    the boundaries are ignored); None where it cannot be read."""
    func = _fallback()
    return None if func is None else func.args.kwarg is not None


def probe_verl(tree: ast.Module) -> Decision:
    func = syntax.find_function(tree, FUNCTION)
    if func is None:
        if syntax.find_function(tree, "qwen3_5_base_forward") is not None:
            return NO_DELTA_NET_FORWARD.decision(
                "verl 0.8 has no delta-net forward of its own: transformers' layers run (judged on their targets)"
            )
        return unrecognized(f"{QWEN3_5.verl_forward} has neither {FUNCTION} nor qwen3_5_base_forward")
    helper = syntax.find_function(tree, "_packed_chunk_gated_delta_rule")
    if (
        syntax.parameters(func) != PARAMETERS
        or helper is None
        or not syntax.calls(func, helper.name)
        or not syntax.calls(helper, "_call_accepts_kwarg")
        or not syntax.has_string(helper, "cu_seqlens")
    ):
        return unrecognized(f"{FUNCTION} is not verl 0.9's (cu_seqlens to a delta rule that takes them)")
    if fla_in_use():
        return FLA_KEEPS_SAMPLES_APART.decision(
            "packed samples kept apart by FLA: verl hands its varlen kernel the boundaries, and its context-parallel "
            "kernel runs under Ulysses"
        )
    takes_kwargs = _fallback_takes_kwargs()
    if takes_kwargs is None:
        return unrecognized(f"transformers' Qwen3.5 modeling has no {FALLBACK}")
    if takes_kwargs:
        return FALLBACK_IGNORES_BOUNDARIES.decision(
            "packed samples kept apart by the plugin: without FLA verl hands transformers' torch fallback cu_seqlens, "
            "which it takes as **kwargs and ignores (transformers >= 5.9): samples would mix"
        )
    return PER_SAMPLE_LOOP.decision(
        "packed samples kept apart by the plugin: without FLA verl splits them in a Python loop (right, one kernel "
        "per sample) and has no Ulysses SP; the plugin's varlen path is faster and runs SP"
    )


def _linear_attn_keywords(decoder_forward: ast.FunctionDef) -> set[str] | None:
    calls = [
        n
        for n in syntax.call_nodes(decoder_forward, "linear_attn")
        if isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"
    ]
    return {k.arg for k in calls[0].keywords} if len(calls) == 1 else None


def probe_transformers(tree: ast.Module, family: Family) -> Decision:
    verl = verl_forward_tree(QWEN3_5)
    if isinstance(verl, Decision):
        return verl
    if syntax.find_function(verl, FUNCTION) is not None and syntax.mentions(
        environment.tree(MONKEY_PATCH) or ast.Module(body=[], type_ignores=[]), FUNCTION
    ):
        return REPLACES_LAYER_FORWARD.decision(
            f"verl replaces this layer's forward with its {FUNCTION} (its own target)"
        )
    prefix = family.prefix
    layer = syntax.find_function(syntax.find_class(tree, f"{prefix}GatedDeltaNet"), "forward")
    decoder = syntax.find_function(syntax.find_class(tree, f"{prefix}DecoderLayer"), "forward")
    if layer is None or decoder is None:
        return unrecognized(f"no {prefix}GatedDeltaNet.forward or {prefix}DecoderLayer.forward")
    keywords = _linear_attn_keywords(decoder)
    if (
        syntax.parameters(layer)[:3] != ["self", "hidden_states", "cache_params"]
        or "position_ids" not in syntax.parameters(decoder)
        or keywords is None
        or "hidden_states" not in keywords
        or keywords & {"cu_seqlens", "cu_seq_lens_q", "seq_idx"}
    ):
        return unrecognized(
            f"{prefix}DecoderLayer does not call self.linear_attn(hidden_states=...) without boundaries as "
            "transformers 5.2 to 5.10 do"
        )
    return NO_BOUNDARIES.decision(
        "packed samples kept apart by the plugin: verl 0.8 passes this layer no boundaries, so its convolution and "
        "recurrence run across packed samples (FLA or not), and under Ulysses each rank's starts from zero"
    )


def _apply_verl(module: ModuleType, decision: Decision) -> None:
    from verl_qwen3vl_plugin.patches.qwen3_5_packed_delta_net.replacement import packed_forward

    originals.wrap(module, FUNCTION, packed_forward)


def _transformers_target(family: Family) -> Target:
    prefix = family.prefix

    def apply(imported: ModuleType, decision: Decision) -> None:
        from verl_qwen3vl_plugin.patches.qwen3_5_packed_delta_net.replacement import (
            boundary_decoder_forward,
            boundary_packed_forward,
        )

        originals.wrap(getattr(imported, f"{prefix}GatedDeltaNet"), "forward", boundary_packed_forward)
        originals.wrap(getattr(imported, f"{prefix}DecoderLayer"), "forward", boundary_decoder_forward)

    return Target(
        module=family.modeling,
        probe=lambda tree: probe_transformers(tree, family),
        apply=apply,
        absent=absent_family(family).when_absent(family.missing("transformers")),
        reads=(QWEN3_5.verl_forward, MONKEY_PATCH),
        shapes=(
            absent_family(family),
            *(
                s.narrowed(transformers=shipped(family))
                for s in (NO_VERL_QWEN3_5, NO_BOUNDARIES, REPLACES_LAYER_FORWARD)
            ),
        ),
    )


DETAILS = """\
**Where it bites.** verl's `use_remove_padding=True`, its default and what its Qwen3.5 FSDP examples set, packs each
micro-batch into one row. verl 0.9.1's `[vllm]` extra pins transformers 5.9.0, whose torch fallback ignores the
boundaries. Under Ulysses SP verl 0.8.0 slices the sequence, so each rank's recurrence starts from zero mid-sequence
(verl #5762, #6486); verl 0.9.0 keeps the state across ranks only with FLA's context-parallel kernel (verl#6660).
Nothing says the log-probs are wrong. With the patch off, packed against each sample alone through verl's FSDP
engine, they differ by 0.15 (Qwen3.5) and 0.09 (Qwen3.5-MoE) on verl 0.8.0 with transformers 5.3.0, and by 0.47 and
0.21 on verl 0.9.1 with transformers 5.10.4 (measured with `tests/patches/qwen3_5_packed_delta_net/test_numerics.py`,
which asserts more than 1e-2).

**Details of the change.** The layout of a packing is built once and shared by every layer
of the forward. The solve inside a chunk is a block inverse made of matmuls only, the same code on every device. On
verl 0.8 under SP, the group's packed position ids are all-gathered once per forward to find the boundaries. Under
Ulysses each rank runs whole sequences on its heads with its slice of the convolution weight, `A_log` and `dt_bias`,
the exchange done by verl's `gather_seq_scatter_heads`. On verl 0.8 with FLA, the layer's FLA kernel is given the
boundaries verl never passed. On an H200 the varlen path is 4.7x to 6.6x faster than
verl's per-sample loop, and level with it on one CPU thread (`docs/performance.md`).

**Tests.** `tests/patches/qwen3_5_packed_delta_net/test_numerics.py` compares the kernels with transformers' fallback
run one sample at a time (lengths 0, 1, 20, 37, 64, 65, 90 and 130, fp32 and bf16, forward and gradients). It runs
both tiny models through verl's engine packed against alone, with the patch off as the control, checks that packing
order does not matter, and runs the Ascend path on the CPU reference `torch_npu` ops. SP = 2 against SP = 1 on two
gloo ranks is in `tests/patches/qwen3_vl_vision_dp/test_ulysses.py`, whose Qwen3.5 has delta-net layers. FLA itself
is not run (no CPU build): its call is checked with a stand-in that records the boundaries.

**Upstream plan.** `upstream/qwen3_5_packed_delta_net/` is the pull request for main (verl >= 0.9, whose decoder
layer passes `cu_seqlens`): `delta_net_varlen.py` becomes `verl/models/transformers/gated_delta_net_varlen.py`, and
`qwen3_5_gated_delta_net_forward` is decorated with `packed_forward`, which runs the varlen path wherever FLA does
not, the head exchange under Ulysses instead of FLA's context-parallel kernel. Its test runs both tiny models packed
against alone through `apply_monkey_patch`, and the layer at SP = 2 on two gloo ranks. `boundary_decoder_forward`
and `boundary_packed_forward` (verl 0.8) have no counterpart. The kernel tests could follow as they are, with the
numbers of `benchmarks/delta_net_varlen.py` and `benchmarks/gpu_delta_net.py` attached.
"""

PATCH = Patch(
    name="qwen3_5_packed_delta_net",
    title="packed Qwen3.5 samples kept apart in the gated delta-net layers, Ulysses SP without FLA",
    group=MODEL,
    targets=(
        Target(
            module=QWEN3_5.verl_forward,
            probe=probe_verl,
            apply=_apply_verl,
            absent=NO_VERL_QWEN3_5.when_absent(QWEN3_5.missing("verl")),
            shapes=(
                NO_VERL_QWEN3_5,
                NO_DELTA_NET_FORWARD,
                PER_SAMPLE_LOOP,
                FALLBACK_IGNORES_BOUNDARIES,
                FLA_KEEPS_SAMPLES_APART,
            ),
            reads=(MONKEY_PATCH, QWEN3_5.modeling),
        ),
        *(_transformers_target(family) for family in FAMILIES),
    ),
    why=(
        "Three of every four Qwen3.5 decoder layers are gated delta-net layers, whose recurrent state and causal "
        "convolution must restart at each of verl's packed samples. They do not with transformers >= 5.9's torch "
        "fallback on verl 0.9 (no FLA: always on Ascend), nor anywhere on verl 0.8, and Ulysses SP without FLA is "
        "wrong (0.8, and 0.9 on >= 5.9) or refused (0.9 on <= 5.8): log-probs are silently wrong."
    ),
    how=(
        "verl_qwen3vl_plugin.patches.qwen3_5_packed_delta_net.replacement.packed_forward wraps verl 0.9's layer "
        "forward (boundary_packed_forward transformers' on verl 0.8, with boundary_decoder_forward reading the "
        "boundaries from the packed position ids): "
        "packed rows run delta_net_varlen's chunked rule and convolution, every sample from a zero state, in one pass "
        "over all samples' chunks; under Ulysses one all-to-all to head shards and one back. Cached generation, "
        "unpacked batches and verl 0.9's FLA path are passed through."
    ),
    upstream=("verl#6660", "verl#5762", "verl#6486"),
    remove_when="verl hands the boundaries to every delta rule that honours them and runs Ulysses without FLA, in the "
    "oldest verl you run with Qwen3.5.",
    details=DETAILS,
)
