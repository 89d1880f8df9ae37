"""Targets of ``qwen3_5_layer_attributes``: transformers' ``modeling_qwen3_5`` and ``modeling_qwen3_5_moe``. verl's
Qwen3.5 layer forwards read their attributes on ``self``, so the classes get the old names back, read-only, and
verl's forwards run as written: ``layer_type`` on ``<Family>DecoderLayer``, each kernel of ``DELTA_NET_KERNELS`` on
``<Family>GatedDeltaNet``.

The probe first collects the attributes of ``RENAMED_LAYER_ATTRIBUTES`` and ``DELTA_NET_KERNELS`` (the
replacement's) that the functions of verl's ``qwen3_5`` module read on ``self``.

- ``BLOCK_TYPE``: verl reads ``self.layer_type``, and the decoder layer's ``__init__`` sets ``self.block_type`` and
  no ``self.layer_type``. Every kernel attribute verl reads is set.
- ``MODULE_KERNELS``: verl reads a kernel attribute that the delta-net's ``__init__`` does not set, and the module
  defines the matching function of ``DELTA_NET_KERNELS`` decorated ``@use_kernel_func_from_hub_with_fallback(...)``
  (with the rename or without it).
- ``LAYERS_SET_WHAT_VERL_READS``: the ``__init__`` methods set every one of these attributes that verl reads.
- ``RESOLVES_LAYER_NAMES``: verl reads none of them, and its layer forwards (functions named with ``decoder_layer``
  or ``gated_delta_net``) look the layer type (``block_type`` or ``layer_type``) and a kernel up by string, as in
  ``getattr(self, "block_type", None)`` and ``_delta_net_kernel(self, "causal_conv1d_fn")`` (verl#7471), or, for the
  layer type, only through the replacement's reader, ``layer_attribute(self, "layer_type")`` (this patch's pull
  request).
- ``NO_LAYER_FORWARDS``: verl reads none of them, and its module has ``qwen3_5_base_forward`` and no layer forward.
- ``NO_VERL_QWEN3_5``: verl has no ``qwen3_5`` module.
"""

from __future__ import annotations

import ast
from types import ModuleType

from verl_qwen3vl_plugin import environment, originals, syntax
from verl_qwen3vl_plugin.families import QWEN3_5, QWEN3_5_MOE, Family
from verl_qwen3vl_plugin.family_shapes import absent_family, absent_in_verl, shipped, verl_forward_tree
from verl_qwen3vl_plugin.patches.qwen3_5_layer_attributes.replacement import (
    DELTA_NET_KERNELS,
    RENAMED_LAYER_ATTRIBUTES,
    layer_attribute,
)
from verl_qwen3vl_plugin.registry import MODEL, Decision, Patch, Shape, Target, Verdict, unrecognized

NEW_TYPE = RENAMED_LAYER_ATTRIBUTES["layer_type"]  # transformers >= 5.13's name of the layer type
DISPATCHER = "use_kernel_func_from_hub_with_fallback"
MODEL_FORWARD = "qwen3_5_base_forward"  # verl's Qwen3.5 model forward, whatever its layers run
LAYER_WORDS = ("decoder_layer", "gated_delta_net")  # in the names of verl's own layer forwards
READER = layer_attribute.__name__  # what verl's forwards read the layer attributes through, staged upstream


def layer_forwards(tree: ast.Module) -> list[ast.FunctionDef]:
    """The module's functions named for a Qwen3.5 layer (verl 0.9's ``qwen3_5_decoder_layer_forward``, ...)."""
    return [n for n in tree.body if isinstance(n, ast.FunctionDef) and any(w in n.name for w in LAYER_WORDS)]


def resolved_names(functions: list[ast.FunctionDef], through: str | None = None) -> set[str]:
    """The names ``functions`` look up on their layer by string, as in ``getattr(self, "block_type", None)`` or
    verl#7471's ``_delta_net_kernel(self, "causal_conv1d_fn")``; with ``through``, only in calls of that function."""
    return {
        call.args[1].value
        for func in functions
        for call in ast.walk(func)
        if isinstance(call, ast.Call)
        and (through is None or ast.unparse(call.func) == through)
        and len(call.args) >= 2
        and isinstance(call.args[0], ast.Name)
        and call.args[0].id == "self"
        and isinstance(call.args[1], ast.Constant)
        and isinstance(call.args[1].value, str)
    }


NO_VERL_QWEN3_5 = absent_in_verl(QWEN3_5)
NO_LAYER_FORWARDS = Shape(id="verl0.8-no-layer-forwards", verdict=Verdict.NOT_USED, verl=">=0.8,<0.9")
LAYERS_SET_WHAT_VERL_READS = Shape(
    id="layers-set-what-verl-reads", verdict=Verdict.FIXED_UPSTREAM, verl=">=0.9", transformers="<5.13"
)
BLOCK_TYPE = Shape(id="tf5.13-block-type", verdict=Verdict.APPLY, verl=">=0.9", transformers=">=5.13,<5.16")
MODULE_KERNELS = Shape(id="tf5.16-module-kernels", verdict=Verdict.APPLY, verl=">=0.9", transformers=">=5.16")
RESOLVES_LAYER_NAMES = Shape(
    id="verl-resolves-layer-names",
    verdict=Verdict.FIXED_UPSTREAM,
    elsewhere="verl#7471's branch, or this patch's pull request",
)


def verl_reads(tree: ast.Module) -> set[str]:
    """The attributes of ``RENAMED_LAYER_ATTRIBUTES`` and ``DELTA_NET_KERNELS`` that verl's functions read on their
    ``self``."""
    wanted = RENAMED_LAYER_ATTRIBUTES.keys() | DELTA_NET_KERNELS.keys()
    return {
        node.attr
        for func in ast.walk(tree)
        if isinstance(func, ast.FunctionDef) and syntax.parameters(func)[:1] == ["self"]
        for node in ast.walk(func)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Load)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and node.attr in wanted
    }


def _sets(cls: ast.ClassDef | None, attr: str) -> bool:
    init = syntax.find_function(cls, "__init__")
    return init is not None and syntax.assigns_attribute(init, attr)


def missing(tree: ast.Module, family: Family, reads: set[str]) -> tuple[dict[str, str], list[str]] | str:
    """(renamed attribute -> its new name, kernel attributes) that ``reads`` needs and the family's classes lack, or
    why the classes are no known shape."""
    decoder = syntax.find_class(tree, f"{family.prefix}DecoderLayer")
    delta_net = syntax.find_class(tree, f"{family.prefix}GatedDeltaNet")
    renamed = {}
    for old, new in RENAMED_LAYER_ATTRIBUTES.items():
        if old not in reads or _sets(decoder, old):
            continue
        if not _sets(decoder, new):
            return f"{family.prefix}DecoderLayer sets neither {old} nor {new}"
        renamed[old] = new
    kernels = []
    for attr in sorted(reads & DELTA_NET_KERNELS.keys()):
        if _sets(delta_net, attr):
            continue
        function = DELTA_NET_KERNELS[attr]
        if not syntax.called_decorator(syntax.find_function(tree, function), DISPATCHER):
            return f"{family.prefix}GatedDeltaNet sets no {attr}, and {function} is no @{DISPATCHER} function"
        kernels.append(attr)
    return renamed, kernels


def _reading_no_old_name(verl: ast.Module) -> Decision:
    """verl's Qwen3.5 module when no function of it reads an old name on ``self``."""
    layers = layer_forwards(verl)
    if not layers and syntax.find_function(verl, MODEL_FORWARD) is not None:
        return NO_LAYER_FORWARDS.decision(
            "verl installs no Qwen3.5 layer forwards of its own: transformers' run as they are"
        )
    resolved = resolved_names(layers)
    # verl#7471 looks the new name up; this patch's pull request reads the old one through the replacement's reader.
    layer_type = NEW_TYPE in resolved or RENAMED_LAYER_ATTRIBUTES.keys() & resolved_names(layers, READER)
    if layer_type and resolved & DELTA_NET_KERNELS.keys():
        return RESOLVES_LAYER_NAMES.decision(
            "verl's Qwen3.5 layer forwards look up the layer type and the delta-net kernels by name (verl#7471, or "
            "this patch's pull request)"
        )
    return unrecognized(
        f"{QWEN3_5.verl_forward} neither reads the old layer names nor looks up {NEW_TYPE} and the kernels by name "
        f"(verl#7471), and is not verl 0.8's ({MODEL_FORWARD} without layer forwards)"
    )


def probe(tree: ast.Module, family: Family) -> Decision:
    verl = verl_forward_tree(QWEN3_5)
    if isinstance(verl, Decision):
        return verl
    reads = verl_reads(verl)
    if not reads:
        return _reading_no_old_name(verl)
    found = missing(tree, family, reads)
    if isinstance(found, str):
        return unrecognized(found)
    renamed, kernels = found
    if not renamed and not kernels:
        return LAYERS_SET_WHAT_VERL_READS.decision(
            f"{family.prefix}'s layers set every attribute verl's Qwen3.5 forwards read"
        )
    lacks = [f"{family.prefix}DecoderLayer.{old} (now {new}, transformers >= 5.13)" for old, new in renamed.items()]
    if kernels:
        lacks.append(f"{family.prefix}GatedDeltaNet.{'/'.join(kernels)} (module-level, transformers >= 5.16)")
    return (MODULE_KERNELS if kernels else BLOCK_TYPE).decision(
        f"verl's Qwen3.5 forwards read {' and '.join(lacks)}: AttributeError on the first forward"
    )


def _target(family: Family) -> Target:
    def apply(module: ModuleType, decision: Decision) -> None:
        from verl_qwen3vl_plugin.patches.qwen3_5_layer_attributes.replacement import (
            dispatched_kernel,
            restored_attribute,
        )

        found = missing(environment.tree(family.modeling), family, verl_reads(environment.tree(QWEN3_5.verl_forward)))
        renamed, kernels = found  # the decision was APPLY on this very source
        for old in renamed:
            originals.add(getattr(module, f"{family.prefix}DecoderLayer"), old, restored_attribute(old))
        for attr in kernels:
            # Read once here: a function that is no dispatcher is refused at import, not at the first forward.
            dispatched_kernel(getattr(module, DELTA_NET_KERNELS[attr]))
            originals.add(getattr(module, f"{family.prefix}GatedDeltaNet"), attr, restored_attribute(attr))

    return Target(
        module=family.modeling,
        probe=lambda tree: probe(tree, family),
        apply=apply,
        absent=absent_family(family).when_absent(family.missing("transformers")),
        reads=(QWEN3_5.verl_forward,),
        shapes=(
            absent_family(family),
            *(
                shape.narrowed(transformers=shipped(family))
                for shape in (
                    NO_VERL_QWEN3_5,
                    NO_LAYER_FORWARDS,
                    LAYERS_SET_WHAT_VERL_READS,
                    BLOCK_TYPE,
                    MODULE_KERNELS,
                )
            ),
            RESOLVES_LAYER_NAMES,
        ),
    )


DETAILS = """\
**Seen.** verl 0.9.x users who moved transformers past verl's pin for Qwen3.5 report the AttributeError. The same
rename broke axolotl's Qwen3.5 patch (axolotl#3972) and Trinity-RFT's (Trinity-RFT#612).
`tests/patches/qwen3_5_layer_attributes/test_probes.py` runs verl's own layer forwards on a tiny Qwen3.5. On
transformers >= 5.13 (the `forward` nox session) the run without the patch dies of that AttributeError, and the run
with it gives what transformers' own forwards give.

**Why attributes and not new forwards.** Restoring the attribute contract leaves verl's forwards as their authors
wrote them, with their FLA and context-parallel path, and `qwen3_5_packed_delta_net` still wraps them. A kernel
dispatcher whose closure lacks `implementation` and `torch_function` is refused with a `RuntimeError` when the target
is imported. The patch's status is then `failed`, with a WARNING, and nothing is guessed.

**Upstream plan.** `upstream/qwen3_5_layer_attributes/` is the pull request for main: verl's layer forwards read
each attribute through `layer_attribute`, the function the plugin's restored attributes read, so it reads what each
release has; its test (`tests/models/test_qwen3_5_layer_attributes_on_cpu.py`) runs a tiny Qwen3.5 through verl's
forwards, on a transformers >= 5.16 job (proven on 5.22.2). verl#7471 (open) is the same fix in another form: it
resolves the kernels FLA first and hides the torch rule's `**kwargs`, so that verl loops over packed samples.
"""

PATCH = Patch(
    name="qwen3_5_layer_attributes",
    title="verl 0.9's Qwen3.5 layer forwards on transformers >= 5.13: the attributes they read",
    group=MODEL,
    targets=tuple(_target(family) for family in (QWEN3_5, QWEN3_5_MOE)),
    why=(
        "verl 0.9.x's Qwen3.5 decoder-layer and gated delta-net forwards read layer attributes that transformers 5.13 "
        "renamed (layer_type is block_type) and 5.16 moved to module-level kernels (causal_conv1d_fn, "
        "chunk_gated_delta_rule, ...): with verl's transformers pin overridden, the first Qwen3.5 forward raises "
        "AttributeError."
    ),
    how=(
        "The classes get the old names back, read-only: layer_type reads block_type, and each kernel attribute is "
        "what transformers' module-level function dispatches to (FLA or causal-conv1d where found at import, else "
        "transformers' torch function, or None for the convolution: verl's own), as transformers <= 5.15 set them."
    ),
    upstream=("verl#7471",),
    remove_when="the verl you run with Qwen3.5 reads transformers' new names (verl#7471), or you keep transformers "
    "below 5.13 (verl 0.9.1's pin is < 5.11).",
    details=DETAILS,
)
