"""A response holding a sampled vision placeholder, through verl's own code: its ``compute_log_prob`` (verl 0.7's
actor, or the FSDP engine on >= 0.8) on a tiny Qwen3-VL-MoE micro-batch with images and a video, and its agent
loop's ``_compute_position_ids`` on one sample (the processor: a stand-in holding the tokenizer's ids and the tiny
model's ``get_rope_index``, as verl binds it).

    placeholder_response.py

Prints one JSON object: per placeholder, the error each pass raised (None: none).
"""

import inspect
import json
from types import SimpleNamespace

import torch
from ulysses_ranks import error_of, one_rank_group  # tests/_child, on every child's PYTHONPATH

from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay import selftest as replay
from verl_qwen3vl_plugin.selftest.tiny_models import IMAGE_TOKEN, TOKENS, VIDEO_TOKEN, image_prompt


def with_placeholder(batch, token, sample):
    """``batch`` with ``token`` sampled in ``sample``'s response (each sample's micro-batch holds images or a
    video, so upstream's count check sees it)."""
    out = dict(batch)
    out["input_ids"] = batch["input_ids"].clone()
    out["responses"] = batch["responses"].clone()
    out["input_ids"][sample, -2] = out["responses"][sample, -2] = token
    return out


def agent_loop_positions(model, token):
    from verl.experimental.agent_loop import agent_loop

    owner = next(c for c in vars(agent_loop).values() if inspect.isclass(c) and "_compute_position_ids" in vars(c))
    grid = torch.tensor([[1, 4, 4]])
    ids = torch.cat([image_prompt(grid), torch.tensor([[5, token, 6]])], dim=1)
    names = {"<|image_pad|>": TOKENS["image_token_id"], "<|video_pad|>": TOKENS["video_token_id"]}
    names["<|vision_start|>"] = TOKENS["vision_start_token_id"]
    tokenizer = SimpleNamespace(convert_tokens_to_ids=names.get, unk_token_id=None, decode=lambda ids: str(ids))
    processor = SimpleNamespace(tokenizer=tokenizer, get_rope_index=model.model.get_rope_index, **TOKENS)
    inputs = {"image_grid_thw": grid}
    if "mm_token_type_ids" in inspect.signature(model.model.get_rope_index).parameters:
        inputs["mm_token_type_ids"] = torch.zeros_like(ids)  # as the processor returns it on transformers >= 5.3
    worker = SimpleNamespace(processor=processor)
    return error_of(lambda: owner._compute_position_ids(worker, ids, torch.ones_like(ids), inputs))


if __name__ == "__main__":
    import verl  # noqa: F401  (the plugin activates here, as in a user's worker)

    from verl_qwen3vl_plugin.selftest.ulysses import install_cpu_stand_ins

    install_cpu_stand_ins()
    one_rank_group()
    model, batch = replay.build(), replay.batch_of()
    out = {"clean": error_of(lambda: replay.verl_pass(model, batch))}
    for name, token, sample in (("image", IMAGE_TOKEN, 1), ("video", VIDEO_TOKEN, 3)):
        placed = with_placeholder(batch, token, sample)
        out[name] = error_of(lambda placed=placed: replay.verl_pass(model, placed))
        out[f"agent_loop_{name}"] = agent_loop_positions(model, token)
    print(json.dumps(out))
