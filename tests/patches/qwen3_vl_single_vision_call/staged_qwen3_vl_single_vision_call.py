"""Qwen3-VL's and Qwen3.5's ``_get_input_embeds`` make one vision-tower call per micro-batch, whatever it holds, so
FSDP ranks holding different media make the same tower collectives. Two gloo ranks, the tower sharded with FSDP2 as
verl wraps it (each block, then the tower): rank 0's micro-batch holds an image and a video, rank 1's two images.
Each rank must call the tower once, and its embeddings (and Qwen3-VL's deepstack features) and the tower's gradients
must equal those of its micro-batch computed alone on the unsharded tower (the gradients averaged over the ranks, as
FSDP reduces them). Before the fix rank 0 called the tower twice (images, then videos) and rank 1 once, so their
collectives no longer paired (a hang under NCCL, a gloo error, or wrong parameters): the test stops a rank at its
second call, and bounds the ranks in time."""

import importlib
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

WORLD = 2
# Bounds of a pass whose ranks fall out of step: gloo's collective timeout, and the wall-clock limit of the two ranks.
COLLECTIVE_TIMEOUT_S, WALL_TIMEOUT_S = 20, 300
IMAGE, VIDEO, VISION_START = 60, 61, 62
TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START)
TEXT = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
)
VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=32,
    num_position_embeddings=16,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
)
MERGE = VISION["spatial_merge_size"] ** 2
# Per rank: its micro-batch's images and videos as (t, h, w) patch grids.
MEDIA = [{"image": [[1, 4, 6]], "video": [[2, 4, 4]]}, {"image": [[1, 4, 4], [1, 2, 2]], "video": []}]


def tiny_qwen3_vl():
    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}
    config = Qwen3VLConfig(
        text_config={**TEXT, "rope_scaling": rope}, vision_config={**VISION, "deepstack_visual_indexes": [1]}, **TOKENS
    )
    return Qwen3VLForConditionalGeneration(config)


def tiny_qwen3_5():
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    rope = {"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True, "partial_rotary_factor": 0.5}
    text = {**TEXT, "layer_types": ["full_attention"], "rope_parameters": rope}
    return Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=VISION, **TOKENS))


FAMILIES = {"qwen3_vl": tiny_qwen3_vl, "qwen3_5": tiny_qwen3_5}


def seeded(build):
    """The same weights on every rank and in every build."""
    model = build()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model


def micro_batch(media: dict, seed: int) -> dict:
    """``_get_input_embeds``'s arguments: a placeholder run per image (and per frame group of a video), then text."""
    generator = torch.Generator().manual_seed(seed)
    ids, inputs = [], {}
    for kind, token in (("image", IMAGE), ("video", VIDEO)):
        grids = media[kind]
        for t, h, w in grids:
            runs = [t * h * w] if kind == "image" else [h * w] * t
            for patches in runs:
                ids += [VISION_START] + [token] * (patches // MERGE)
        if grids:
            grid = torch.tensor(grids)
            patch_dim = 3 * VISION["temporal_patch_size"] * VISION["patch_size"] ** 2
            pixels = torch.randn(int(grid.prod(-1).sum()), patch_dim, generator=generator)
            inputs["pixel_values" if kind == "image" else "pixel_values_videos"] = pixels
            inputs["image_grid_thw" if kind == "image" else "video_grid_thw"] = grid
    input_ids = torch.tensor([ids + [1, 2, 3, 4]])
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), **inputs}


def one_tower_call(module, args) -> None:
    """Stops a rank at a second tower call for its micro-batch, before its collectives can pair with a peer's
    next ones."""
    module.calls += 1
    assert module.calls == 1, f"rank {dist.get_rank()} called the vision tower a second time for one micro-batch"


def embed_and_backward(family: str, model, inputs: dict) -> list[torch.Tensor]:
    """The embeddings (and deepstack features) through verl's ``_get_input_embeds``, after a seeded loss's
    backward."""
    out = importlib.import_module(f"verl.models.transformers.{family}")._get_input_embeds(model.model, **inputs)
    tensors = [out["inputs_embeds"], *(out.get("deepstack_visual_embeds") or [])]
    generator = torch.Generator().manual_seed(1)
    sum((t * torch.randn(t.shape, generator=generator)).sum() for t in tensors).backward()
    return [t.detach() for t in tensors]


def run_rank(rank: int, family: str, rendezvous: str) -> None:
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD, timeout=timeout)
    try:
        inputs = micro_batch(MEDIA[rank], seed=rank)
        alone = seeded(FAMILIES[family])
        expected = embed_and_backward(family, alone, inputs)
        expected_grads = [p.grad for p in alone.model.visual.parameters()]
        for grad in expected_grads:  # FSDP averages the gradients over the ranks
            dist.all_reduce(grad)
            grad /= WORLD

        model = seeded(FAMILIES[family])
        mesh = init_device_mesh("cpu", (WORLD,))
        for block in model.model.visual.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model.model.visual, mesh=mesh)
        model.model.visual.calls = 0
        model.model.visual.register_forward_pre_hook(one_tower_call)
        got = embed_and_backward(family, model, inputs)
        assert model.model.visual.calls == 1
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b)
        grads = [p.grad.full_tensor() for p in model.model.visual.parameters()]
        for a, b in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_ranks_with_different_media_make_one_tower_call_each(family, tmp_path):
    if family == "qwen3_5":
        pytest.importorskip("transformers.models.qwen3_5")
    context = mp.start_processes(
        run_rank, args=(family, str(tmp_path / "rendezvous")), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + WALL_TIMEOUT_S
    try:
        while not context.join(timeout=1):  # raises where a rank failed
            if time.monotonic() > deadline:
                pytest.fail(f"the ranks were still running after {WALL_TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
