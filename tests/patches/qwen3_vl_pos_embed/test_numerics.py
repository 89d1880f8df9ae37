"""The plugin's ``fast_pos_embed_interpolate`` against upstream implementations measured in the same process.

Only the plugin's function is under test: upstream's (transformers' method, verl's device-safe copy) serve as the
references it must match, never compared with each other.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from verl_qwen3vl_plugin.patches.qwen3_vl_pos_embed import replacement as qwen3_vl
from verl_qwen3vl_plugin.patches.qwen3_vl_pos_embed.replacement import fast_pos_embed_interpolate
from verl_qwen3vl_plugin.patches.qwen3_vl_pos_embed.selftest import forward_check, gradient_check, references
from verl_qwen3vl_plugin.selftest.tiny_models import vision_tower

# The references: transformers' own method where its vision forward still calls it (4.57 to 5.8), and verl's fix.
REFERENCES = references()

# Qwen3.5's (transformers >= 5.2, verl >= 0.8): on a Qwen3.5 tower, the plugin's function against each.
QWEN3_5_REFERENCES = references("qwen3_5")

GRIDS = {
    "2x2": [[1, 2, 2]],
    "images": [[1, 16, 16], [1, 38, 50], [1, 64, 22]],
    "images_and_videos": [[1, 4, 6], [3, 8, 8], [1, 30, 44], [16, 32, 32], [2, 2, 2]],
    "long_thin": [[1, 2, 128], [1, 256, 2], [1, 2, 2]],
    "square_128": [[1, 128, 128]],
}


@pytest.mark.skipif(not REFERENCES, reason="no upstream reference on this stack")
@pytest.mark.parametrize("reference", list(REFERENCES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("grid", list(GRIDS))
def test_forward_bit_identical_to_upstream(reference, grid, dtype):
    out = fast_pos_embed_interpolate(vision_tower(dtype=dtype), torch.tensor(GRIDS[grid]))
    assert out.shape == (int(torch.tensor(GRIDS[grid]).prod(-1).sum()), 32)
    check = forward_check(fast_pos_embed_interpolate, REFERENCES[reference], reference, GRIDS[grid], dtype)
    assert check.ok, check


@pytest.mark.skipif(not REFERENCES, reason="no upstream reference on this stack")
@pytest.mark.parametrize("reference", list(REFERENCES))
@pytest.mark.parametrize("grid", ["images_and_videos", "long_thin"])
def test_fp32_gradient_matches_upstream(reference, grid):
    check = gradient_check(fast_pos_embed_interpolate, REFERENCES[reference], reference, GRIDS[grid])
    assert check.ok, check


@pytest.mark.skipif(not QWEN3_5_REFERENCES, reason="no Qwen3.5 here (transformers < 5.2)")
@pytest.mark.parametrize("reference", list(QWEN3_5_REFERENCES))
@pytest.mark.parametrize("grid", ["images_and_videos", "long_thin", "square_128"])
def test_qwen3_5_tower_bit_identical_to_qwen3_5_upstream(reference, grid):
    for dtype in (torch.float32, torch.bfloat16):
        check = forward_check(
            fast_pos_embed_interpolate, QWEN3_5_REFERENCES[reference], reference, GRIDS[grid], dtype, family="qwen3_5"
        )
        assert check.ok, check
    check = gradient_check(
        fast_pos_embed_interpolate, QWEN3_5_REFERENCES[reference], reference, GRIDS[grid], family="qwen3_5"
    )
    assert check.ok, check


@pytest.mark.skipif(not REFERENCES, reason="no upstream reference on this stack")
@pytest.mark.parametrize("hidden", [32, 256])  # the gradient scatters with index_put_ below 128, index_add_ above
def test_chunk_and_step_boundaries_anywhere(monkeypatch, hidden):
    """Corners built 36 patches at a time and steps of 5 rows: boundaries inside merge blocks, images and videos,
    and a short last step in every chunk. Still bit-identical, with upstream's gradient."""
    monkeypatch.setattr(qwen3_vl, "_CHUNK_PATCHES", 36)
    monkeypatch.setitem(qwen3_vl._STEP_ELEMENTS, "cpu", 5 * hidden)
    grid = GRIDS["images_and_videos"]
    for name, reference in REFERENCES.items():
        for dtype in (torch.float32, torch.bfloat16):
            check = forward_check(fast_pos_embed_interpolate, reference, name, grid, dtype, hidden)
            assert check.ok, check
        check = gradient_check(fast_pos_embed_interpolate, reference, name, grid, hidden)
        assert check.ok, check


def test_bf16_gradient_matches_fp32_reference():
    """bf16 tables get the fp32 gradient rounded once (upstream's bf16 sums drift further)."""
    grid_thw = torch.tensor(GRIDS["images_and_videos"])
    grad_out = torch.randn(int(grid_thw.prod(-1).sum()), 32, generator=torch.Generator().manual_seed(1))
    bf16 = vision_tower(dtype=torch.bfloat16)
    fast_pos_embed_interpolate(bf16, grid_thw).backward(grad_out.bfloat16())
    fp32 = vision_tower().to(torch.float32)
    fp32.pos_embed.weight.data.copy_(bf16.pos_embed.weight.data.float())
    fast_pos_embed_interpolate(fp32, grid_thw).backward(
        grad_out.bfloat16().float(),
    )
    torch.testing.assert_close(bf16.pos_embed.weight.grad.float(), fp32.pos_embed.weight.grad, rtol=2**-8, atol=1e-5)


def test_empty_grid_gives_empty_embedding():
    out = fast_pos_embed_interpolate(vision_tower(), torch.zeros(0, 3, dtype=torch.long))
    assert out.shape == (0, 32)


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        ([[1, 3, 4]], r"multiples of spatial_merge_size=2; bad rows \(index, \[t, h, w\]\): \[\(0, \[1, 3, 4\]\)\]"),
        ([[1, 4, 4], [1, 4, 5]], r"\[\(1, \[1, 4, 5\]\)\]"),
        ([[0, 4, 4]], r"t, h, w >= 1; bad rows .*\[\(0, \[0, 4, 4\]\)\]"),
        ([[1, -2, 4]], r"t, h, w >= 1"),
        ([1, 4, 4], r"shape \(num_images, 3\).*got \(3,\)"),
        ([[1, 4, 4, 1]], r"got \(1, 4\)"),
    ],
)
def test_bad_grid_is_rejected_with_the_offending_rows(grid, message):
    with pytest.raises(ValueError, match=message):
        fast_pos_embed_interpolate(vision_tower(), torch.tensor(grid))


def test_float_grid_is_rejected():
    with pytest.raises(ValueError, match="integers"):
        fast_pos_embed_interpolate(vision_tower(), torch.tensor([[1.0, 4.0, 4.0]]))


class _OffloadedTable(nn.Module):
    """``pos_embed`` as FSDP2 with CPU offload presents it: the parameter on one device, the table gathered onto the
    ids' device only inside forward. The parameter sits on ``meta`` here, so on a CPU-only machine the grid (CPU)
    and the weight are still on different devices, and anything built on the weight's device ends up on ``meta``."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.num_embeddings = weight.shape[0]
        self.weight = nn.Parameter(torch.empty_like(weight, device="meta"))
        self.gathered = weight.detach().clone().requires_grad_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.gathered.to(ids.device))


def offloaded_tower() -> nn.Module:
    tower = vision_tower()
    tower.pos_embed = _OffloadedTable(tower.pos_embed.weight)
    return tower


def test_result_follows_grid_device_not_the_weights_and_gradient_reaches_the_gathered_table():
    """The CPU-offload mismatch, with ``meta`` standing in for the host and the CPU for the accelerator."""
    grid_thw = torch.tensor(GRIDS["images_and_videos"])
    tower = offloaded_tower()
    out = fast_pos_embed_interpolate(tower, grid_thw)
    assert out.device == grid_thw.device
    assert torch.equal(out, fast_pos_embed_interpolate(vision_tower(), grid_thw))
    out.sum().backward()
    assert tower.pos_embed.gathered.grad is not None and tower.pos_embed.gathered.grad.abs().sum() > 0


@pytest.mark.skipif("transformers" not in REFERENCES, reason="transformers' vision forward no longer calls its method")
def test_offloaded_table_catches_upstreams_device_mix_up():
    """The stand-in can fail: transformers' method builds its ids on the weight's device, and its result lands
    there instead of on the grid's."""
    out = REFERENCES["transformers"](offloaded_tower(), torch.tensor([[1, 4, 4]]))
    assert out.device == torch.device("meta")
