"""A user's process (``import verl``: the plugin activates): a tiny Qwen3.5 and Qwen3.5-MoE with images through verl's
``apply_monkey_patch`` and FSDP engine, packed against each sample alone, with the patch and with the upstream layers
(``selftest.qwen3_5_packed_delta_net``); and one micro-batch packed in two orders. Prints one JSON object."""

import json

import torch
import verl  # noqa: F401

from verl_qwen3vl_plugin.selftest import qwen3_5_packed_delta_net as selftest
from verl_qwen3vl_plugin.selftest.ulysses import engine_forward, micro_batch

result = {}
for kind in ("qwen3_5", "qwen3_5_moe"):
    model = selftest.verl_model(kind)
    result[kind] = {"on": selftest.packed_against_alone(model), "off": selftest.packed_against_alone(model, patched=False)}
with torch.no_grad():  # dynamic batching regroups samples: a sample's log-probs must not depend on its neighbours
    first, _ = engine_forward(model, micro_batch(selftest.SAMPLES), sp=1)
    last, _ = engine_forward(model, micro_batch(selftest.SAMPLES[::-1]), sp=1)
lengths = micro_batch(selftest.SAMPLES)["attention_mask"].sum(-1).tolist()
result["order_diff"] = float((torch.cat(first.split(lengths)[::-1]) - last).abs().max())
print(json.dumps(result))
