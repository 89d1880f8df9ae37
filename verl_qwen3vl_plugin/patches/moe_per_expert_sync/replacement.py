"""verl 0.8's weight sync of packed Qwen3-VL-MoE and Qwen3.5-MoE experts, sent to the rollout as per-expert keys.

Why: transformers 5 packs the experts as ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I), and verl 0.8's
FSDP engine sends them as they are stored. vLLM's Qwen3-VL-MoE loader up to 0.24 transposes every packed expert
tensor, assuming the checkpoint's (E, H, 2I): the sync fails on a shape, or, where H == 2I, loads scrambled gate and
up projections. Per-expert keys (``experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``, each (out, in)) are
what every vLLM release loads for both families.
How: the engine's weight stream is split lazily, one expert at a time, by the packed layout of the class that holds
the experts (verl's Ascend block keeps transformers 4.57's layout, transformers 5's own classes their new one).
When it applies, and when it can be removed: the ``moe_per_expert_sync`` spec.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch

OUT_IN = "out_in"  # transformers 5: gate_up_proj (E, 2I, H), down_proj (E, H, I)
IN_OUT = "in_out"  # transformers 4.57 and verl's NPU block: gate_up_proj (E, H, 2I), down_proj (E, I, H)
MODEL_TYPES = frozenset({"qwen3_vl_moe", "qwen3_5_moe"})
GATE_UP, DOWN = ".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"


def packed_layout(model: torch.nn.Module, layouts: Mapping[tuple[str, str], str]) -> str | None:
    """The one packed layout of ``model``'s experts, by the class of each module holding a 3-D ``gate_up_proj``
    (``layouts``: ``(module, class name)`` -> layout); None where no module holds one.

    The class decides, not the shape: where H == 2I both layouts have the same shape. An experts class of no known
    layout, or two layouts in one model, raise: a guess would send scrambled experts without a sign.
    """
    found = set()
    for module in model.modules():
        packed = getattr(module, "gate_up_proj", None)
        if not isinstance(packed, torch.Tensor) or packed.dim() != 3:
            continue
        known = [layouts[key] for c in type(module).__mro__ if (key := (c.__module__, c.__qualname__)) in layouts]
        if not known:
            raise RuntimeError(
                f"moe_per_expert_sync: {type(module).__qualname__} holds packed experts in no known layout; "
                "set VERL_QWEN3VL_PLUGIN_DISABLE=moe_per_expert_sync to send them as stored"
            )
        found.add(known[0])
    if len(found) > 1:
        raise RuntimeError(f"moe_per_expert_sync: experts in two packed layouts in one model: {sorted(found)}")
    return found.pop() if found else None


def _matrix(tensor: torch.Tensor, layout: str) -> torch.Tensor:
    """One expert's projection as a checkpoint stores it, (out, in), in memory of its own."""
    return (tensor if layout == OUT_IN else tensor.T).contiguous()


def per_expert(weights: Iterable[tuple[str, torch.Tensor]], layout: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with each packed ``gate_up_proj`` / ``down_proj`` replaced by its experts' checkpoint keys, in
    expert order; everything else passes as it comes. Lazy: one expert's copies at a time."""
    for name, tensor in weights:
        if tensor.dim() == 3 and name.endswith(GATE_UP):
            base = name.removesuffix(".gate_up_proj")
            gate, up = tensor.chunk(2, dim=1 if layout == OUT_IN else 2)
            for expert in range(tensor.size(0)):
                yield f"{base}.{expert}.gate_proj.weight", _matrix(gate[expert], layout)
                yield f"{base}.{expert}.up_proj.weight", _matrix(up[expert], layout)
        elif tensor.dim() == 3 and name.endswith(DOWN):
            base = name.removesuffix(".down_proj")
            for expert in range(tensor.size(0)):
                yield f"{base}.{expert}.down_proj.weight", _matrix(tensor[expert], layout)
        else:
            yield name, tensor


def per_expert_stream(get_per_tensor_param: Callable, layouts: Mapping[tuple[str, str], str]) -> Callable:
    """verl's ``FSDPEngine.get_per_tensor_param``, its stream split per expert for Qwen3-VL-MoE and Qwen3.5-MoE.

    Arguments pass through as given, and the second value it returns (the LoRA config) as verl returns it.
    """

    @functools.wraps(get_per_tensor_param)
    def wrapper(self, *args, **kwargs):
        weights, peft_config = get_per_tensor_param(self, *args, **kwargs)
        if getattr(self.model_config.hf_config, "model_type", None) in MODEL_TYPES:
            layout = packed_layout(self.module, layouts)
            if layout is not None:
                weights = per_expert(weights, layout)
        return weights, peft_config

    return wrapper
