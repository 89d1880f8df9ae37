"""Self-test of ``vision_placeholder_ban``: the logits ban on a stand-in for vLLM's model holding a tiny Qwen3-VL
config (and a text-only one), and the refusal of a sampled placeholder in an image prompt."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from verl_qwen3vl_plugin.selftest import Check

VOCAB = 160


class ServedModel(torch.nn.Module):
    """What verl's patch touches of vLLM's model: ``config`` and ``compute_logits``."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits.clone()


def banned_logits(config) -> tuple[torch.Tensor, torch.Tensor]:
    """(the served model's logits after verl's patch and the plugin's, its logits before)."""
    from verl_qwen3vl_plugin.patches.vision_placeholder_ban.replacement import ban_placeholders

    model = ServedModel(config)
    ban_placeholders(lambda model, vocab_size: None)(model, VOCAB)
    return model.compute_logits(torch.zeros(3, 8)), model.logits


def run() -> list[Check]:
    from verl_qwen3vl_plugin.patches.vision_placeholder_ban.replacement import refuse_strays
    from verl_qwen3vl_plugin.selftest.tiny_models import (
        IMAGE_TOKEN,
        TOKENS,
        VIDEO_TOKEN,
        image_prompt,
        tiny_qwen3_vl_moe_config,
    )

    checks = []
    after, before = banned_logits(tiny_qwen3_vl_moe_config())
    banned = torch.isinf(after).all(0).nonzero().flatten().tolist()
    rest = [i for i in range(VOCAB) if i not in (IMAGE_TOKEN, VIDEO_TOKEN)]
    ok = banned == sorted((IMAGE_TOKEN, VIDEO_TOKEN)) and torch.equal(after[:, rest], before[:, rest])
    checks.append(Check("placeholder logits -inf, the rest untouched", ok, f"-inf at {banned}"))
    text_after, text_before = banned_logits(SimpleNamespace(vocab_size=VOCAB))
    checks.append(Check("text-only model unchanged", torch.equal(text_after, text_before), "no ids to ban"))
    prompt = image_prompt(torch.tensor([[1, 4, 4]]))
    ids = SimpleNamespace(**TOKENS)
    refuse_strays(prompt, ids)  # a real image span: nothing to refuse
    errors = []
    for token in (IMAGE_TOKEN, VIDEO_TOKEN):
        try:
            refuse_strays(torch.cat([prompt, torch.tensor([[5, token, 6]])], dim=1), ids)
        except ValueError as exc:
            errors.append(str(exc))
    ok = len(errors) == 2 and all("placeholder token" in e and "Fix:" in e for e in errors)
    checks.append(Check("sampled placeholders refused by name", ok, errors[0][:90] if errors else "no error"))
    return checks
