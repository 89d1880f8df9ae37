"""Qwen3-VL's vision position embeddings (``fast_pos_embed_interpolate``) are built on ``grid_thw``'s device, from
the table the ``pos_embed`` module's own forward returns, whatever device its parameter sits on. Under FSDP2 with CPU
offload the parameter is a host-side shard and the forward gathers the table onto the accelerator, so indices built on
the parameter's device fail the vision forward with a device mismatch. Here a parameter on ``meta`` stands for the
host and the CPU for the accelerator, so the mismatch shows on a CPU-only machine. Also: the result matches bilinear
interpolation (``align_corners=True``) of the table, for images and videos; a malformed ``grid_thw`` gets a
``ValueError`` naming its rows; an empty one gives an empty embedding.

The vectorization itself is a speed-up: the reference comparison is its equality test.
"""

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeVisionConfig
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

MERGE = 2
SIDE = 12  # a 12 x 12 position table, interpolated to larger and smaller grids
HIDDEN = 32
TOWERS = {
    "qwen3_vl": (Qwen3VLVisionConfig, Qwen3VLVisionModel),
    "qwen3_vl_moe": (Qwen3VLMoeVisionConfig, Qwen3VLMoeVisionModel),
}
GRIDS = {
    "images": [[1, 4, 6], [1, 16, 16], [1, 2, 30]],
    "images_and_videos": [[1, 4, 6], [3, 8, 10], [1, 2, 2], [2, 24, 4]],
}


def tower(name: str) -> nn.Module:
    config_class, model_class = TOWERS[name]
    config = config_class(
        depth=1, hidden_size=HIDDEN, intermediate_size=16, num_heads=1, out_hidden_size=HIDDEN,
        num_position_embeddings=SIDE * SIDE, deepstack_visual_indexes=[], patch_size=4, temporal_patch_size=2,
        spatial_merge_size=MERGE, in_channels=3,
    )  # fmt: skip
    model = model_class(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model.eval()


class OffloadedEmbedding(nn.Module):
    """``pos_embed`` as FSDP2 with CPU offload presents it: the parameter on another device than the computation
    (``meta`` here), the whole table placed on the ids' device only inside forward, as FSDP's all-gather does."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.weight = nn.Parameter(torch.empty_like(embedding.weight, device="meta"))
        self.gathered = embedding.weight.detach().clone().requires_grad_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.gathered.to(ids.device))


def offloaded(model: nn.Module) -> nn.Module:
    model.pos_embed = OffloadedEmbedding(model.pos_embed)
    return model


def bilinear(table: torch.Tensor, grid: list[list[int]]) -> torch.Tensor:
    """The table resized to each (h, w) by bilinear interpolation with aligned corners, rows in the vision tower's
    merge order (each MERGE x MERGE block of patches together), repeated for each of the t frames."""
    square = table.detach().float().T.reshape(1, HIDDEN, SIDE, SIDE)
    parts = []
    for t, h, w in grid:
        resized = F.interpolate(square, size=(h, w), mode="bilinear", align_corners=True)[0].permute(1, 2, 0)
        blocks = resized.reshape(h // MERGE, MERGE, w // MERGE, MERGE, HIDDEN).permute(0, 2, 1, 3, 4)
        parts.append(blocks.reshape(h * w, HIDDEN).repeat(t, 1))
    return torch.cat(parts)


@pytest.mark.parametrize("name", list(TOWERS))
def test_vision_forward_with_the_table_gathered_elsewhere(name):
    """The whole vision forward runs with the parameter away from the computation, gives the same output as with the
    table in place, and the gradient reaches the gathered table."""
    grid_thw = torch.tensor(GRIDS["images_and_videos"])
    pixels = torch.randn(int(grid_thw.prod(-1).sum()), 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(1))
    in_place = tower(name)
    expected = in_place(pixels, grid_thw)[0]
    model = offloaded(tower(name))
    out = model(pixels, grid_thw)[0]
    assert out.device == pixels.device
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.square().sum().backward()
    assert model.pos_embed.gathered.grad is not None and model.pos_embed.gathered.grad.abs().sum() > 0


@pytest.mark.parametrize("grid", list(GRIDS))
@pytest.mark.parametrize("name", list(TOWERS))
def test_interpolation_on_the_grid_device_matches_bilinear(name, grid):
    model = offloaded(tower(name))
    grid_thw = torch.tensor(GRIDS[grid])
    out = model.fast_pos_embed_interpolate(grid_thw)
    assert out.device == grid_thw.device
    torch.testing.assert_close(out, bilinear(model.pos_embed.gathered, GRIDS[grid]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        ([[1, 3, 4]], r"multiples of spatial_merge_size=2; bad rows \(index, \[t, h, w\]\): \[\(0, \[1, 3, 4\]\)\]"),
        ([[1, 4, 4], [1, 4, 6], [1, 4, 5]], r"\[\(2, \[1, 4, 5\]\)\]"),
        ([[0, 4, 4]], r"t, h, w >= 1; bad rows .*\[\(0, \[0, 4, 4\]\)\]"),
        ([[1, -2, 4]], r"t, h, w >= 1"),
        ([1, 4, 4], r"shape \(num_images, 3\).*got \(3,\)"),
        ([[1.0, 4.0, 4.0]], r"integers"),
    ],
)
def test_malformed_grid_is_rejected_naming_its_rows(grid, message):
    with pytest.raises(ValueError, match=message):
        tower("qwen3_vl").fast_pos_embed_interpolate(torch.tensor(grid))


def test_empty_grid_gives_an_empty_embedding():
    out = tower("qwen3_vl").fast_pos_embed_interpolate(torch.zeros(0, 3, dtype=torch.long))
    assert out.shape == (0, HIDDEN)
