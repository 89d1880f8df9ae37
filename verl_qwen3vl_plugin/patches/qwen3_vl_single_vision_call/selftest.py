"""Checks of the ``qwen3_vl_single_vision_call`` patch: the plugin's ``get_input_embeds`` against verl's own
``_get_input_embeds`` on a tiny Qwen3-VL, and ``get_input_embeds_qwen3_5`` against verl's Qwen3.5 one on a tiny
Qwen3.5 (verl >= 0.8), in one CPU process.

Per micro-batch: the number of vision-tower calls (one, whatever it holds), the outputs (bit-identical where verl
also makes one call; within fp32 rounding where the tower now sees images and videos in one batch), the tower's
gradients, the token-count error, and the host reads (a CPU proxy for host syncs: ``tolist``, ``item`` and the ops
whose output size depends on data), which must not exceed verl's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from verl_qwen3vl_plugin.selftest import Check

# A micro-batch per case, as ``selftest.ulysses.micro_batch`` takes them: per sample its images, videos ("v").
CASES = {
    "image + video": [[(1, 4, 6), ("v", 2, 4, 4)], [(1, 2, 2)]],
    "video before image": [[("v", 2, 2, 4), (1, 4, 4)]],
    "images only": [[(1, 4, 6)], [(1, 2, 2), (1, 4, 4)]],
    "video only": [[("v", 3, 4, 4)]],
    "text only": [[], []],
}
# The tower batches images and videos together: fp32 rounding of its matmuls, relative to each tensor's largest entry.
RTOL = 1e-5
DATA_DEPENDENT = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select")


class HostReads(TorchFunctionMode):
    """Counts host reads of tensor data: ``tolist`` here, the rest (``item``, data-sized outputs) by dispatch."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self._dispatch = _DataDependentOps(self)

    def __enter__(self):
        self._dispatch.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self._dispatch.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist:
            self.count += 1
        return func(*args, **(kwargs or {}))


class _DataDependentOps(TorchDispatchMode):
    def __init__(self, counter: HostReads):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        indices = args[1] if name.startswith("aten.index") and len(args) > 1 else ()
        bool_index = isinstance(indices, list | tuple) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices
        )
        if name.startswith(DATA_DEPENDENT) or bool_index:
            self.counter.count += 1
        return func(*args, **(kwargs or {}))


def model_inputs(samples: list[list[tuple]]) -> dict:
    """verl's arguments of ``_get_input_embeds`` for a micro-batch: the samples' inputs concatenated in order."""
    from verl_qwen3vl_plugin.selftest.ulysses import micro_batch

    batch = micro_batch(samples)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        parts = [mm[key] for mm in batch["multi_modal_inputs"] if mm is not None and key in mm]
        inputs[key] = torch.cat(parts) if parts else None
    return inputs


def run_one(function, model: torch.nn.Module, inputs: dict) -> dict:
    """``function``'s outputs, its tower calls and host reads, and the tower's gradients of a seeded loss."""
    calls = []
    hook = model.model.visual.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[0]))
    model.zero_grad(set_to_none=True)
    try:
        with HostReads() as reads:
            out = function(model.model, **inputs)
    finally:
        hook.remove()
    tensors = [out["inputs_embeds"], *(out.get("deepstack_visual_embeds") or [])]
    generator = torch.Generator().manual_seed(1)
    sum((t * torch.randn(t.shape, generator=generator)).sum() for t in tensors).backward()
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.model.visual.parameters()]
    return {"out": out, "tensors": tensors, "grads": grads, "calls": calls, "reads": reads.count}


def family_functions(family: str) -> tuple[Callable, Callable, Callable[[], torch.nn.Module]]:
    """(verl's ``_get_input_embeds``, the plugin's, a seeded tiny model) of ``family``: qwen3_vl or qwen3_5."""
    import importlib

    from verl_qwen3vl_plugin import originals
    from verl_qwen3vl_plugin.patches.qwen3_vl_single_vision_call import replacement as replacement
    from verl_qwen3vl_plugin.patches.qwen3_vl_single_vision_call.spec import FUNCTION
    from verl_qwen3vl_plugin.selftest.tiny_models import randomize, tiny_qwen3_5, tiny_qwen3_vl

    verl = originals.original(importlib.import_module(f"verl.models.transformers.{family}"), FUNCTION)
    if family == "qwen3_5":
        return verl, replacement.get_input_embeds_qwen3_5, lambda: randomize(tiny_qwen3_5(), seed=0)
    return verl, replacement.get_input_embeds, lambda: randomize(tiny_qwen3_vl(), seed=0)


def compare(name: str, samples: list[list[tuple]], family: str = "qwen3_vl") -> Check:
    upstream, plugin, build = family_functions(family)
    model = build()
    inputs = model_inputs(samples)
    verl, ours = run_one(upstream, model, inputs), run_one(plugin, model, inputs)
    exact = len(verl["calls"]) == 1  # verl too made one call: the same tower batch, so the same bits

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        if exact or a.shape != b.shape:
            return torch.equal(a, b)
        return bool((a - b).abs().max() <= RTOL * a.abs().max())

    masks = (verl["out"].get("visual_pos_masks"), ours["out"].get("visual_pos_masks"))
    ok = (
        len(ours["calls"]) == 1
        and set(ours["out"]) == set(verl["out"])
        and len(verl["tensors"]) == len(ours["tensors"])
        and all(same(a, b) for a, b in zip(verl["tensors"], ours["tensors"], strict=True))
        and all(same(a, b) for a, b in zip(verl["grads"], ours["grads"], strict=True))
        and (masks[0] is None) == (masks[1] is None)
        and (masks[0] is None or torch.equal(*masks))
        and ours["reads"] <= verl["reads"]
    )
    detail = (
        f"tower calls {len(verl['calls'])} -> {len(ours['calls'])}, host reads {verl['reads']} -> {ours['reads']}, "
        f"{'bit-identical' if exact else 'within fp32 rounding'}"
    )
    label = "" if family == "qwen3_vl" else f" ({family})"
    return Check(f"one vision call{label}: {name}", ok, detail)


def token_mismatch() -> Check:
    """verl's token-count checks still hold: an image token short of the image's features raises."""
    from verl_qwen3vl_plugin.patches.qwen3_vl_single_vision_call.replacement import get_input_embeds
    from verl_qwen3vl_plugin.selftest.tiny_models import IMAGE_TOKEN, randomize, tiny_qwen3_vl

    model = randomize(tiny_qwen3_vl(), seed=0)
    inputs = model_inputs(CASES["image + video"])
    ids = inputs["input_ids"]
    first = int((ids == IMAGE_TOKEN).nonzero()[0, 1])
    ids[0, first] = 1  # one image token replaced by text
    try:
        get_input_embeds(model.model, **inputs)
    except ValueError as exc:
        return Check("one vision call: token count mismatch raises", "Image features and image tokens" in str(exc),
                     str(exc))  # fmt: skip
    return Check("one vision call: token count mismatch raises", False, "no error on a mismatched image")


def run() -> list[Check]:
    from verl_qwen3vl_plugin.selftest.tiny_models import has_qwen3_5

    checks = [*(compare(name, samples) for name, samples in CASES.items()), token_mismatch()]
    if has_qwen3_5(verl=True):
        checks += [compare(name, samples, "qwen3_5") for name, samples in CASES.items()]
    return checks
