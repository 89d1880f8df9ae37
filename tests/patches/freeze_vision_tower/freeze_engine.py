"""verl's real FSDP engine with ``actor.freeze_vision_tower`` on two gloo ranks holding different images.

    freeze_engine.py dense|moe|qwen3_5|qwen3_5_moe on|off fsdp2|fsdp [lora]

On each rank: verl's ``FSDPActorConfig`` (the setting, the strategy, an ``FSDPEngineConfig``) and its engine, built
by verl's own ``FSDPEngine._build_model_optimizer`` (LoRA, FSDP wrapping, AdamW) around a tiny model that replaces
only the hub download; then two steps of ``forward_step``, ``backward`` and verl's ``optimizer_step``. Prints one
JSON list (per rank): the largest change of the vision tower's and of the language model's parameters (gathered
whole), the optimizer states held for the tower's parameters, whether the tower's output was in an autograd graph,
and the patch's statuses. fp32 throughout (``mixed_precision`` fp32), so a change is never lost to rounding.

CPU stand-ins: ``verl_qwen3vl_plugin.selftest.ulysses`` names them; verl's device helpers answer ``cpu``.
"""

import json
import sys

import torch
from seeded_pass import full  # tests/_child, on every child's PYTHONPATH

from verl_qwen3vl_plugin.selftest.ranks import on_two_ranks
from verl_qwen3vl_plugin.selftest.ulysses import (
    build_model,
    built_engine,
    engine_batch,
    install_cpu_stand_ins,
    micro_batch,
)

SAMPLES = ([[(1, 4, 6)], [(1, 2, 2), (1, 4, 4)]], [[(1, 8, 8)], [(1, 2, 4)]])  # per rank: different images
TOWER = "model.visual."


def tower_of(model: torch.nn.Module) -> torch.nn.Module:
    return next(m for m in model.modules() if type(m).__name__.endswith("VisionModel"))


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: full(p).detach().clone() for name, p in model.named_parameters()}


def run_rank(rank, kind, freeze, strategy, lora):
    import verl  # noqa: F401  (the plugin activates here, as in a user's worker)
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    from verl_qwen3vl_plugin import patch_statuses

    install_cpu_stand_ins()
    model = build_model(kind)
    apply_monkey_patch(model, ulysses_sp_size=1, use_remove_padding=True, use_fused_kernels=False)
    engine = built_engine(model, strategy, freeze, lora)
    module = engine.module
    before = snapshot(module)
    graphs = []
    tower_of(module).register_forward_hook(
        lambda _, __, out: graphs.append((out[0] if isinstance(out, tuple) else out.pooler_output).requires_grad)
    )
    weights = torch.randn(64, generator=torch.Generator().manual_seed(rank))

    def loss_function(model_output, data, dp_group):
        log_probs = model_output["log_probs"].values()
        return (log_probs * weights[: log_probs.numel()]).sum(), {}

    module.train()
    batch = engine_batch(micro_batch(SAMPLES[rank]))
    for _ in range(2):
        engine.optimizer_zero_grad()
        loss, _ = engine.forward_step(batch, loss_function=loss_function, forward_only=False)
        loss.backward()
        engine.optimizer_step()
    after = snapshot(module)
    tower_ids = {id(p) for p in tower_of(module).parameters()}
    vision = [n for n, p in module.named_parameters() if id(p) in tower_ids]
    text = [n for n in before if n not in vision and ("lora_" in n or not lora)]
    states = [s for p, s in engine.optimizer.state.items() if id(p) in tower_ids and s]
    return {
        "rank": rank,
        "vision_params": len(vision),
        "vision_change": max(float((after[n] - before[n]).abs().max()) for n in vision),
        "text_change": max(float((after[n] - before[n]).abs().max()) for n in text),
        "vision_optimizer_states": len(states),
        "vision_trainable": sum(p.requires_grad for n, p in module.named_parameters() if n in vision),
        "tower_output_in_graph": graphs,
        "statuses": {s.target: s.status.value for s in patch_statuses() if s.patch == "freeze_vision_tower"},
    }


if __name__ == "__main__":
    kind, freeze, strategy, *rest = sys.argv[1:]
    print(json.dumps(on_two_ranks(run_rank, kind, freeze == "on", strategy, rest == ["lora"], timeout=500)))
