"""Checks of the ``freeze_vision_tower`` patch: the plugin's freeze on each tiny model this transformers ships, then
one full forward, backward and AdamW step.

The tower's every parameter (patch embedding, position table, blocks, merger, deepstack mergers) must be bitwise
unchanged and hold no optimizer state, its output must carry no autograd graph, and the language model must change.
Where verl's FSDP engine is not what the patch recognises, the check reports the verdict instead.
"""

from __future__ import annotations

import inspect

import torch

from verl_qwen3vl_plugin.selftest import Check


def _step(model: torch.nn.Module) -> str | None:
    """What went wrong in one frozen step of ``model``; None where nothing did."""
    from verl_qwen3vl_plugin.patches.freeze_vision_tower.replacement import freeze_towers
    from verl_qwen3vl_plugin.patches.freeze_vision_tower.spec import TOWERS
    from verl_qwen3vl_plugin.selftest.tiny_models import IMAGE_TOKEN, image_prompt, pixel_values

    (tower,) = freeze_towers(model, TOWERS)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    in_graph = []
    tower.register_forward_hook(
        lambda _, __, out: in_graph.append((out[0] if isinstance(out, tuple) else out.pooler_output).requires_grad)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grid = torch.tensor([[1, 4, 4]])
    ids = image_prompt(grid)
    inputs = {"input_ids": ids, "pixel_values": pixel_values(grid), "image_grid_thw": grid}
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:  # transformers >= 5.10 asks for it
        inputs["mm_token_type_ids"] = (ids == IMAGE_TOKEN).long()
    model.train()
    model(**inputs).logits.sum().backward()
    optimizer.step()
    frozen = {id(p) for p in tower.parameters()}
    names = {name for name, p in model.named_parameters() if id(p) in frozen}
    moved = [name for name, p in model.named_parameters() if not torch.equal(p, before[name])]
    if in_graph != [False]:
        return f"the tower's output was in an autograd graph: {in_graph}"
    if any(id(p) in frozen for p in optimizer.state):
        return "the optimizer holds state for the tower"
    if names & set(moved) or not set(moved) - names:
        return f"changed: {sorted(set(moved) & names)[:3]} of the tower, {len(set(moved) - names)} others"
    return None


def run() -> list[Check]:
    from verl_qwen3vl_plugin.patches.freeze_vision_tower.spec import PATCH
    from verl_qwen3vl_plugin.registry import Verdict, decide_installed
    from verl_qwen3vl_plugin.selftest.tiny_models import has_qwen3_5, randomize, tiny_qwen3_5, tiny_qwen3_vl

    decision = decide_installed(PATCH, PATCH.target("verl.workers.engine.fsdp.transformer_impl"))
    name = "frozen vision tower"
    if decision.verdict is not Verdict.APPLY:
        return [
            Check(name, decision.verdict is not Verdict.UNRECOGNIZED, f"{decision.verdict.value}: {decision.reason}")
        ]
    models = {"Qwen3-VL": tiny_qwen3_vl, **({"Qwen3.5": tiny_qwen3_5} if has_qwen3_5() else {})}
    checks = []
    for label, build in models.items():
        problem = _step(randomize(build(), seed=0))
        detail = problem or "one AdamW step: the tower bitwise unchanged, no state, no graph; the text model moved"
        checks.append(Check(f"{name} ({label})", problem is None, detail))
    return checks
