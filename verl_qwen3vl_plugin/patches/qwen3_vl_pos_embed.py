"""Patch: the plugin's ``fast_pos_embed_interpolate`` on ``Qwen3VLVisionModel`` and ``Qwen3VLMoeVisionModel``.

Why: transformers 4.57.x to 5.8.x place the interpolation's index and weight tensors on the table's device, the CPU
under FSDP2 CPU offload, so the vision forward fails with a device mismatch (verl PR #6131, #6332).
How: a post-import hook sets the plugin's function on each vision class as soon as transformers' module is imported.
On verl >= 0.8, ``apply_monkey_patch`` installs verl's own (slower, bit-identical) copy while building the model, so
it is wrapped to put the plugin's back afterwards.
Where it does nothing: transformers >= 5.9 no longer calls the method (its index math runs on ``grid_thw``'s device).
Remove when: transformers >= 5.9 is the floor of the supported stacks.
"""

from __future__ import annotations

from types import ModuleType

import wrapt

from verl_qwen3vl_plugin.compat import dist_version, method_calls
from verl_qwen3vl_plugin.registry import POS_EMBED, Status, disabled_verdict, guarded, on_import, record, start_install

NAME = POS_EMBED
METHOD = "fast_pos_embed_interpolate"
# transformers module -> the vision class in it whose forward calls the interpolation.
TARGETS = {
    "transformers.models.qwen3_vl.modeling_qwen3_vl": "Qwen3VLVisionModel",
    "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe": "Qwen3VLMoeVisionModel",
}
VERL_MONKEY_PATCH = "verl.models.transformers.monkey_patch"

# The classes patched in this process, each with transformers' own method, kept before it was replaced.
_upstream: dict[type, object] = {}


def decide(cls: type) -> tuple[Status, str]:
    """Whether the patch applies to ``cls`` on this stack; the hook and the doctor both ask this."""
    disabled = disabled_verdict(NAME)
    if disabled:
        return disabled
    if not method_calls(cls, "forward", METHOD):
        return Status.NOT_USED, (
            f"transformers {dist_version('transformers')}: {cls.__name__}.forward does not call {METHOD} "
            "(it computes on grid_thw's device)"
        )
    return Status.APPLIED, f"{cls.__name__}.forward calls {METHOD}, upstream's builds on pos_embed's device"


def upstream_method(cls: type):
    """transformers' own ``fast_pos_embed_interpolate`` of ``cls``, even after the plugin replaced it."""
    return _upstream.get(cls, cls.__dict__.get(METHOD))


def _set_ours(cls: type) -> None:
    from verl_qwen3vl_plugin.models.qwen3_vl import fast_pos_embed_interpolate

    setattr(cls, METHOD, fast_pos_embed_interpolate)


def _on_transformers_module(module: ModuleType) -> None:
    cls = getattr(module, TARGETS[module.__name__])
    status, reason = decide(cls)
    if status is Status.APPLIED:
        _upstream.setdefault(cls, cls.__dict__.get(METHOD))
        _set_ours(cls)
        reason = ", ".join(c.__name__ for c in _upstream) + f".{METHOD} replaced (computes on grid_thw's device)"
    record(NAME, status, reason)


def _after_verl_monkey_patch(wrapped, instance, args, kwargs):
    """verl >= 0.8 sets its own copy on both classes while building a model: put the plugin's back."""
    result = wrapped(*args, **kwargs)
    for cls in _upstream:
        guarded(NAME, _set_ours, cls)
    return result


def _on_verl_monkey_patch(module: ModuleType) -> None:
    wrapt.wrap_function_wrapper(module, "apply_monkey_patch", _after_verl_monkey_patch)


def install() -> None:
    """Register the post-import hooks (once per process); targets already imported are patched right away."""
    if not start_install(NAME, "waiting for transformers' Qwen3-VL modeling modules to be imported"):
        return
    for target in TARGETS:
        on_import(NAME, target, _on_transformers_module)
    on_import(NAME, VERL_MONKEY_PATCH, _on_verl_monkey_patch)
