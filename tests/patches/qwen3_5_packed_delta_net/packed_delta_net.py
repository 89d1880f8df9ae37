"""A user's process (``import verl``: the plugin activates): a tiny Qwen3.5 and Qwen3.5-MoE with images through verl's
``apply_monkey_patch`` and FSDP engine, packed against each sample alone, with the patch and with the upstream layers
(the patch's ``selftest``); and one micro-batch packed in two orders. Prints one JSON object.

``npu``: the path Ascend takes, on the CPU: verl's real ``npu_patch`` (its norms, rotary embedding and Qwen3.5-MoE
experts) over the package's reference ``torch_npu`` ops."""

import contextlib
import json
import sys

import torch
import verl  # noqa: F401

from verl_qwen3vl_plugin.patches.qwen3_5_packed_delta_net import selftest
from verl_qwen3vl_plugin.selftest.npu_reference import fake_torch_npu
from verl_qwen3vl_plugin.selftest.ulysses import engine_forward, micro_batch

NPU = sys.argv[1:] == ["npu"]
if NPU:  # transformers' device probes first: they must find no torch_npu
    import transformers.models.qwen3_5.modeling_qwen3_5
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe  # noqa: F401
batch = micro_batch(selftest.SAMPLES)
order = list(range(len(selftest.SAMPLES)))[::-1]
lengths = batch["attention_mask"].sum(-1).tolist()
result = {}
with fake_torch_npu() if NPU else contextlib.nullcontext():
    if NPU:
        from verl.models.transformers import npu_patch

        getattr(npu_patch, "apply_npu_patches", lambda: None)()  # verl >= 0.9 patches here, 0.8 at import
        result["npu_norm"] = transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeRMSNorm.forward.__module__
    for kind in ("qwen3_5", "qwen3_5_moe"):
        model = selftest.verl_model(kind)
        result[kind] = {
            "on": selftest.packed_against_alone(model),
            "off": selftest.packed_against_alone(model, patched=False),
        }
        # dynamic batching regroups samples: a sample's log-probs must not depend on its neighbours
        with torch.no_grad():
            first, _ = engine_forward(model, batch, sp=1)
            last, _ = engine_forward(model, {key: value[order] for key, value in batch.items()}, sp=1)
        result[kind]["order_diff"] = float((torch.cat([first.split(lengths)[i] for i in order]) - last).abs().max())
print(json.dumps(result))
