"""A TEST-ONLY stand-in for vLLM 0.18.1's loading of MoE experts, written from its semantics (not its code): the
real vLLM 0.18.1 cannot be installed here (its wheels pin another torch). It models only the experts, for one
tensor-parallel rank of one:

- vLLM's parameters per MoE layer: ``w13`` (E, 2I, H), gate rows then up rows, and ``w2`` (E, H, I).
- Packed keys (``mlp.experts.gate_up_proj`` / ``down_proj``): Qwen3-VL-MoE's ``load_weights``
  (``models/qwen3_vl_moe.py``, 0.11 to 0.24) transposes the last two dims of every packed tensor, assuming the
  checkpoint's (E, H, 2I) / (E, I, H), then cuts gate and up with ``chunk(2, dim=-2)``; Qwen3.5-MoE's
  (``models/qwen3_5.py``, 0.17 to 0.24) does not transpose. Each expert's slice then goes to the per-expert loader.
- Per-expert keys (``mlp.experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``): straight to the per-expert
  loader, in both families.
- ``FusedMoE``'s per-expert loader: for gate / up, take the first ``2I / 2`` rows of what it gets (``narrow`` on dim
  0) and copy them into that half of ``w13[e]``; for down, the first ``I`` columns (``narrow`` on dim 1) into
  ``w2[e]``. ``narrow`` past the end and ``copy_`` of another shape raise ``RuntimeError``, as in torch.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

PACKED = ("gate_up_proj", "down_proj")
SHARDS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


class LayerExperts:
    """One MoE layer's expert parameters as vLLM holds them, zero until loaded."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        self.w13 = torch.zeros(num_experts, 2 * intermediate, hidden)
        self.w2 = torch.zeros(num_experts, hidden, intermediate)

    def load_expert(self, weight: torch.Tensor, shard: str, expert: int) -> None:
        if shard == "w2":
            self.w2[expert].copy_(weight.narrow(1, 0, self.w2.shape[2]))
            return
        half = self.w13.shape[1] // 2
        self.w13[expert].narrow(0, 0 if shard == "w1" else half, half).copy_(weight.narrow(0, 0, half))


def load_experts(
    layers: dict[str, LayerExperts], weights: Iterable[tuple[str, torch.Tensor]], transposes_packed: bool
) -> None:
    """Load the expert tensors of ``weights`` into ``layers`` (keyed by the name before ``.mlp.experts.``), as vLLM
    0.18.1's Qwen3-VL-MoE (``transposes_packed``) or Qwen3.5-MoE loader would; other tensors are not modelled."""
    for name, tensor in weights:
        prefix, found, rest = name.partition(".mlp.experts.")
        if not found:
            continue
        layer = layers[prefix]
        if rest in PACKED:
            packed = tensor.transpose(-1, -2) if transposes_packed else tensor
            if rest == "gate_up_proj":
                gate, up = packed.chunk(2, dim=-2)
                for expert in range(packed.shape[0]):
                    layer.load_expert(gate[expert], "w1", expert)
                    layer.load_expert(up[expert], "w3", expert)
            else:
                for expert in range(packed.shape[0]):
                    layer.load_expert(packed[expert], "w2", expert)
            continue
        expert, projection, _ = rest.split(".")
        layer.load_expert(tensor, SHARDS[projection], int(expert))
