"""Under Ulysses SP, ``apply_monkey_patch`` splits the vision tower of Qwen3-VL and Qwen3.5 over the SP group: each
rank runs the tower on a contiguous run of whole images, and the embeddings (and Qwen3-VL's deepstack features) are
all-gathered back. Two gloo ranks in one SP group, the same three images on both (as every rank of a group holds the
same micro-batch), ``apply_monkey_patch`` called twice (an actor and a reference model). Each rank's tower must see
only its share of the patches, the shares must add up to the images, and the embeddings, deepstack features and the
tower's gradients (averaged over the ranks, as FSDP reduces them) must equal SP = 1's, the whole tower on one rank.
Before the change every rank ran the tower on every image."""

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
from verl.models.transformers.monkey_patch import apply_monkey_patch
from verl.utils.transformers_compat import unpack_visual_output
from verl.utils.ulysses import set_ulysses_sequence_parallel_group

WORLD = 2
COLLECTIVE_TIMEOUT_S, WALL_TIMEOUT_S = 20, 300
RTOL = 1e-5
TOKENS = dict(image_token_id=60, video_token_id=61, vision_start_token_id=62)
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
GRID = [[1, 4, 6], [1, 8, 8], [1, 2, 2]]  # 24, 64 and 4 patches


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


def tower_pass(model, sp: int) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """The tower's embeddings and deepstack features, its gradients of a seeded loss, and the patches it ran, with
    verl's Ulysses group set to the world when ``sp`` > 1."""
    grid = torch.tensor(GRID)
    patch_dim = 3 * VISION["temporal_patch_size"] * VISION["patch_size"] ** 2
    pixels = torch.randn(int(grid.prod(-1).sum()), patch_dim, generator=torch.Generator().manual_seed(2))
    seen = []
    visual = model.model.visual
    hook = visual.patch_embed.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[0]))
    set_ulysses_sequence_parallel_group(dist.group.WORLD if sp > 1 else None)
    try:
        embeds, deepstack = unpack_visual_output(visual(pixels, grid_thw=grid))
    finally:
        set_ulysses_sequence_parallel_group(None)
        hook.remove()
    outputs = [embeds, *(deepstack or [])]
    generator = torch.Generator().manual_seed(1)
    sum((t * torch.randn(t.shape, generator=generator)).sum() for t in outputs).backward()
    grads = [p.grad for p in visual.parameters()]
    return [t.detach() for t in outputs], grads, sum(seen)


def assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to fp32 rounding, relative to the tensor's largest entry: a rank's tower computes a subset of the rows,
    and the gradients are summed in another order (an element-wise bound fails on entries near zero)."""
    assert got.shape == expected.shape
    difference, scale = float((got - expected).abs().max()), float(expected.abs().max())
    assert difference <= RTOL * scale, f"differs by {difference}, {difference / scale:.1e} of its largest entry"


def run_rank(rank: int, family: str, rendezvous: str) -> None:
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD, timeout=timeout)
    try:
        expected, expected_grads, total = tower_pass(seeded(FAMILIES[family]), sp=1)
        model = seeded(FAMILIES[family])
        for _ in range(2):  # verl patches the classes again for each model it builds
            apply_monkey_patch(model, ulysses_sp_size=WORLD, use_remove_padding=True)
        got, grads, seen = tower_pass(model, sp=WORLD)
        shares = [torch.zeros((), dtype=torch.long) for _ in range(WORLD)]
        dist.all_gather(shares, torch.tensor(seen))
        assert 0 < seen < total, f"rank {rank}'s tower ran {seen} of the {total} patches"
        assert sum(int(s) for s in shares) == total, f"the ranks' towers ran {shares} patches of {total}"
        for a, b in zip(got, expected, strict=True):
            assert_close(a, b)
        for grad in grads:  # FSDP averages the gradients over the ranks
            dist.all_reduce(grad)
            grad /= WORLD
        for a, b in zip(grads, expected_grads, strict=True):
            assert_close(a, b)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sp_ranks_split_the_vision_tower_and_match_sp1(family, tmp_path):
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
