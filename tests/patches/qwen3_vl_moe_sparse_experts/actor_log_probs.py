"""verl's own ``DataParallelPPOActor`` (0.7.x) on a tiny Qwen3-VL-MoE with an image: the log-probs of
``compute_log_prob`` (eval) and of the training forward inside ``update_policy``, on the same batch and weights.

    actor_log_probs.py fp32|bf16

Prints the largest difference; 0 means the on-policy PPO ratio is exactly 1. CPU stand-ins: verl's
``get_device_id`` (it asks ``torch.cuda.current_device()``), and a one-rank gloo process group (the actor logs by
rank). The bf16 model is cast as FSDP mixed precision holds it; autocast is verl's own.
"""

import json
import socket
import sys

import numpy as np
import torch
import verl  # noqa: F401
from tensordict import TensorDict
from verl import DataProto
from verl.workers.actor import dp_actor

from verl_qwen3vl_plugin.selftest.tiny_models import image_prompt, pixel_values, randomize, tiny_qwen3_vl_moe
from verl_qwen3vl_plugin.selftest.ulysses import actor_for

dp_actor.get_device_id = lambda: "cpu"
with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
dtype = sys.argv[1]
# Top-4 of 8 experts: where transformers' own eval and training paths round apart in bf16.
model = randomize(tiny_qwen3_vl_moe(num_experts=8, num_experts_per_tok=4), seed=0)
if dtype == "bf16":
    model = model.to(torch.bfloat16)  # as FSDP mixed precision holds it
grid = torch.tensor([[1, 4, 4]])
prompt = image_prompt(grid, text=4)[0]
bsz, resp_len = 2, 5
responses = torch.randint(1, 90, (bsz, resp_len), generator=torch.Generator().manual_seed(1))
input_ids = torch.cat([prompt.expand(bsz, -1), responses], dim=1)
attention_mask = torch.ones_like(input_ids)
vision, _ = model.model.get_rope_index(input_ids, torch.cat([grid, grid]), None, attention_mask)
text = (attention_mask.cumsum(-1) - 1).unsqueeze(0)
position_ids = torch.cat([text, vision]).transpose(0, 1).contiguous()  # (bsz, 4, seq) as verl's dataset builds
mm = np.array([{"pixel_values": pixel_values(grid, seed=i), "image_grid_thw": grid} for i in range(bsz)], dtype=object)
batch = TensorDict(
    {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "responses": responses,
        "response_mask": torch.ones_like(responses),
    },
    batch_size=[bsz],
)
meta = {"micro_batch_size": 2, "temperature": 1.0, "use_dynamic_bsz": False, "pad_token_id": 0}
data = DataProto(batch=batch, non_tensor_batch={"multi_modal_inputs": mm}, meta_info=meta)
actor = actor_for(model, 1, "bfloat16" if dtype == "bf16" else "float32", use_remove_padding=False)
out = actor.compute_log_prob(data, calculate_entropy=False)
old = out["log_probs"] if isinstance(out, dict) else out[0]  # 0.7.0: the tuple (log_probs, entropys)
captured = []
forward = actor._forward_micro_batch


def recording(micro_batch, temperature, calculate_entropy=False):
    result = forward(micro_batch, temperature=temperature, calculate_entropy=calculate_entropy)
    if actor.actor_module.training:
        # verl 0.7.1 returns a dict, 0.7.0 the tuple (entropy, log_probs)
        log_probs = result["log_probs"] if isinstance(result, dict) else result[1]
        captured.append(log_probs.detach().clone())
    return result


actor._forward_micro_batch = recording
data.batch["old_log_probs"] = old
data.batch["advantages"] = torch.randn(bsz, resp_len, generator=torch.Generator().manual_seed(2))
metrics = actor.update_policy(data)
train = torch.cat(captured)
print(
    json.dumps(
        {
            "dtype": dtype,
            "max_abs_diff": float((train - old).abs().max()),
            "equal": bool(torch.equal(train, old)),
            "experts_forward": type(model.model.language_model.layers[0].mlp.experts).forward.__module__,
        }
    )
)
