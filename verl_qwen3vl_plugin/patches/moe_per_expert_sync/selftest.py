"""Self-test of ``moe_per_expert_sync``: verl's own ``FSDPEngine.get_per_tensor_param``, with the plugin's split, on
tiny Qwen3-VL-MoE and Qwen3.5-MoE models whose hidden size is twice the experts' (where a layout mix-up keeps every
shape). Each expert's three sent matrices, run as plain linear layers, must give what transformers' experts module
gives for tokens routed to that expert alone: the sent keys are the experts, whatever the packing."""

from __future__ import annotations

import torch

from verl_qwen3vl_plugin.selftest import Check

HIDDEN_EQ_2I = {"moe_intermediate_size": 16}  # the tiny models' hidden size is 32
TOLERANCE = 1e-5


def verl_stream(model: torch.nn.Module, split: bool) -> dict[str, torch.Tensor]:
    """What verl's own ``FSDPEngine.get_per_tensor_param`` sends for ``model`` (unsharded, on the CPU), through the
    plugin's split with ``split``, whether or not the hooks installed it in this process."""
    from verl.workers.engine.fsdp import transformer_impl

    from verl_qwen3vl_plugin import originals
    from verl_qwen3vl_plugin.patches.moe_per_expert_sync.replacement import per_expert_stream
    from verl_qwen3vl_plugin.patches.moe_per_expert_sync.spec import ENGINE, METHOD, layouts
    from verl_qwen3vl_plugin.selftest.moe_blocks import engine_weight_stream

    method = originals.original(getattr(transformer_impl, ENGINE), METHOD)
    return engine_weight_stream(model, per_expert_stream(method, layouts()) if split else method)


def experts_check(name: str, model: torch.nn.Module, sent: dict[str, torch.Tensor]) -> Check:
    """Every experts module of ``model`` against the per-expert matrices in ``sent`` (no packed key left): expert
    ``e``'s ``down(act(gate x) * up x)`` equals the module's output with every token routed to ``e`` at weight 1."""
    packed = [k for k in sent if k.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]
    if packed:
        return Check(name, False, f"packed experts sent: {packed[:2]}")
    generator = torch.Generator().manual_seed(0)
    worst, compared = 0.0, 0
    for path, module in model.named_modules():
        if not (path.endswith(".mlp.experts") and isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)):
            continue
        x = torch.randn(5, module.gate_up_proj.shape[-1], generator=generator)
        for expert in range(module.num_experts):
            keys = [f"{path}.{expert}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
            if any(k not in sent for k in keys):
                return Check(name, False, f"{keys[0]} (or its up / down) not sent")
            gate, up, down = (sent[k].float() for k in keys)
            ours = torch.nn.functional.linear(module.act_fn(x @ gate.T) * (x @ up.T), down)
            route = torch.full((len(x), 1), expert)
            with torch.no_grad():
                theirs = module(x, route, torch.ones(len(x), 1))
            worst, compared = max(worst, float((ours - theirs).abs().max())), compared + 1
    ok = compared > 0 and worst <= TOLERANCE
    return Check(name, ok, f"{compared} experts, largest difference {worst:.2e}")


def models() -> dict[str, torch.nn.Module]:
    """The tiny MoE models of both families this transformers ships, hidden == 2 * moe_intermediate."""
    from verl_qwen3vl_plugin.selftest.tiny_models import has_qwen3_5, tiny_qwen3_5, tiny_qwen3_vl_moe

    found = {"Qwen3-VL-MoE": tiny_qwen3_vl_moe(**HIDDEN_EQ_2I)}
    if has_qwen3_5():
        found["Qwen3.5-MoE"] = tiny_qwen3_5(moe=True, **HIDDEN_EQ_2I)
    return found


def run() -> list[Check]:
    from verl_qwen3vl_plugin.patches.moe_per_expert_sync.spec import PATCH
    from verl_qwen3vl_plugin.registry import Verdict, decide_installed

    decision = decide_installed(PATCH, PATCH.targets[0])
    checks = [Check(f"{PATCH.name} decision", decision.verdict is not Verdict.UNRECOGNIZED, decision.reason)]
    if decision.verdict is not Verdict.APPLY:
        return checks
    for label, model in models().items():
        checks.append(
            experts_check(f"{label} per-expert sync == transformers' experts", model, verl_stream(model, True))
        )
    return checks
