"""Self-test of ``qwen3_5_layer_attributes``: verl's own Qwen3.5 decoder-layer and gated delta-net forwards, called on
a tiny Qwen3.5 and Qwen3.5-MoE's layers, give what transformers' own forwards give on this transformers."""

from __future__ import annotations

import json
import types

import torch

from verl_qwen3vl_plugin.selftest import Check, in_child

ATOL = 1e-6
FORWARDS = ("qwen3_5_decoder_layer_forward", "qwen3_5_gated_delta_net_forward")  # verl 0.9's, in its qwen3_5 module


def verl_against_transformers(moe: bool) -> dict:
    """The largest differences between verl's forwards and transformers' on the first linear-attention layer: its
    delta-net alone, and the decoder layer with verl's forwards on both as ``apply_monkey_patch`` installs them."""
    from verl.models.transformers import qwen3_5 as verl_qwen3_5

    from verl_qwen3vl_plugin.selftest.tiny_models import tiny_qwen3_5

    decoder_forward, delta_net_forward = (getattr(verl_qwen3_5, name) for name in FORWARDS)

    text = tiny_qwen3_5(moe=moe).model.language_model
    layer = next(m for m in text.layers if hasattr(m, "linear_attn"))
    hidden = torch.randn(1, 37, text.config.hidden_size, generator=torch.Generator().manual_seed(3))
    position_ids = torch.arange(hidden.shape[1])[None].expand(3, 1, -1)
    rope = text.rotary_emb(hidden, position_ids)
    with torch.no_grad():
        expected_layer, expected_delta_net = layer(hidden, rope), layer.linear_attn(hidden)
        delta_net = (delta_net_forward(layer.linear_attn, hidden) - expected_delta_net).abs().max()
        layer.linear_attn.forward = types.MethodType(delta_net_forward, layer.linear_attn)  # as verl installs it
        decoder = (decoder_forward(layer, hidden, rope) - expected_layer).abs().max()
    return {"decoder_layer": float(decoder), "gated_delta_net": float(delta_net)}


def checks_here() -> list[Check]:
    """In a process of its own, the model hooks installed."""
    import verl  # noqa: F401

    from verl_qwen3vl_plugin.hooks import watch_group
    from verl_qwen3vl_plugin.registry import MODEL

    watch_group(MODEL)
    checks = []
    for moe in (False, True):
        name = f"verl's Qwen3.5{'-MoE' if moe else ''} layer forwards equal transformers'"
        try:
            found = verl_against_transformers(moe)
        except AttributeError as error:
            checks.append(Check(name, False, f"AttributeError: {error}"))
        else:
            checks.append(Check(name, max(found.values()) <= ATOL, str(found)))
    return checks


def run() -> list[Check]:
    from verl_qwen3vl_plugin import environment, syntax
    from verl_qwen3vl_plugin.families import QWEN3_5
    from verl_qwen3vl_plugin.registry import DISABLE_ENV
    from verl_qwen3vl_plugin.selftest.tiny_models import has_qwen3_5

    name = "verl's Qwen3.5 layer forwards"
    if not has_qwen3_5(verl=True):
        return [Check(name, True, "no Qwen3.5 in this verl / transformers: nothing to check")]
    if not all(syntax.find_function(environment.tree(QWEN3_5.verl_forward), f) for f in FORWARDS):
        return [Check(name, True, "verl has no Qwen3.5 layer forwards of its own (verl 0.8): nothing to check")]
    return in_child(__name__, name, drop=(DISABLE_ENV,))


if __name__ == "__main__":
    print(json.dumps([list(c) for c in checks_here()]))
