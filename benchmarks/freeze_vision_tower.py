"""Benchmark: ``actor.freeze_vision_tower`` honoured (the plugin) against ignored (verl's FSDP engine).

1. What the freeze saves for Qwen3-VL-30B-A3B's tower, from its config's vision numbers (no hub download here):
   fp32 AdamW state (exp_avg, exp_avg_sq) and fp32 gradients, and the bf16 bytes each weight sync sends for it.
   The tower is built on the meta device from ``CONFIG_30B_A3B`` and its parameters counted.
2. One actor step (forward, backward, AdamW step) of a small Qwen3-VL with a 4-block tower, freeze on against off,
   same process, alternating, medians: time, and the memory the step holds beyond the weights (on CUDA the peak
   allocation; on the CPU the bytes autograd saves for backward plus gradients plus optimizer state).

    python benchmarks/freeze_vision_tower.py [--images 8] [--repeats 7]
    python benchmarks/freeze_vision_tower.py --smoke   # 1 image, one repeat: runs, no result
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

import torch

# Qwen/Qwen3-VL-30B-A3B-Instruct, config.json "vision_config" (huggingface.co/Qwen/Qwen3-VL-30B-A3B-Instruct, the
# same numbers as benchmarks/vision_dp.py and transformers' Qwen3VLMoeVisionConfig defaults).
CONFIG_30B_A3B = dict(
    depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16,
    temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=2048, num_position_embeddings=2304,
    deepstack_visual_indexes=[8, 16, 24],
)  # fmt: skip
BENCH_TOWER = dict(depth=4, hidden_size=128, intermediate_size=512, num_heads=4, deepstack_visual_indexes=[1])
GIB = 1024**3


def tower_30b_a3b() -> None:
    from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeVisionConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

    with torch.device("meta"):
        tower = Qwen3VLMoeVisionModel(Qwen3VLMoeVisionConfig(**CONFIG_30B_A3B))
    params = sum(p.numel() for p in tower.parameters())
    parts = {
        "blocks": sum(p.numel() for p in tower.blocks.parameters()),
        "mergers": sum(p.numel() for p in [*tower.merger.parameters(), *tower.deepstack_merger_list.parameters()]),
        "patch embedding + position table": sum(
            p.numel() for p in [*tower.patch_embed.parameters(), *tower.pos_embed.parameters()]
        ),
    }
    print(f"Qwen3-VL-30B-A3B vision tower: {params / 1e6:.1f} M parameters "
          f"({', '.join(f'{k} {v / 1e6:.1f} M' for k, v in parts.items())})")  # fmt: skip
    print(
        f"  AdamW state saved (fp32 exp_avg + exp_avg_sq, 8 B/param): {8 * params / GIB:.2f} GiB, over the FSDP group"
    )
    print(
        f"  fp32 gradients saved (4 B/param):                          {4 * params / GIB:.2f} GiB, over the FSDP group"
    )
    print(f"  bf16 bytes per weight sync that later syncs could skip:    {2 * params / GIB:.2f} GiB")


def step_cost(model: torch.nn.Module, inputs: dict) -> tuple[float, int]:
    """Seconds of one forward, backward and AdamW step, and the memory the step held beyond the weights."""
    saved = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.untyped_storage().nbytes())
        return tensor

    cuda = torch.cuda.is_available()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(**inputs).logits.float().pow(2).mean().backward()
    optimizer.step()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if cuda:
        held = torch.cuda.max_memory_allocated() - base
    else:
        state = sum(t.nbytes for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
        held = sum(saved) + sum(p.grad.nbytes for p in model.parameters() if p.grad is not None) + state
    model.zero_grad(set_to_none=True)
    return seconds, held


def actor_step(images: int, repeats: int) -> None:
    from verl_qwen3vl_plugin.patches.freeze_vision_tower.replacement import freeze_towers
    from verl_qwen3vl_plugin.patches.freeze_vision_tower.spec import TOWERS
    from verl_qwen3vl_plugin.selftest.tiny_models import (
        IMAGE_TOKEN,
        image_prompt,
        pixel_values,
        randomize,
        tiny_qwen3_vl,
    )

    device = "cuda" if torch.cuda.is_available() else "cpu"
    models = {mode: randomize(tiny_qwen3_vl(**BENCH_TOWER), seed=0).to(device).train() for mode in ("off", "on")}
    freeze_towers(models["on"], TOWERS)
    grid = torch.tensor([[1, 16, 16]] * images)
    ids = image_prompt(grid, text=32).to(device)
    inputs = {"input_ids": ids, "pixel_values": pixel_values(grid).to(device), "image_grid_thw": grid.to(device)}
    if "mm_token_type_ids" in inspect.signature(models["on"].forward).parameters:  # transformers >= 5.10
        inputs["mm_token_type_ids"] = (ids == IMAGE_TOKEN).long()
    for model in models.values():  # warm-up
        step_cost(model, inputs)
    runs = {mode: [] for mode in models}
    for _ in range(repeats):
        for mode, model in models.items():
            runs[mode].append(step_cost(model, inputs))
    if repeats < 3:
        return
    medians = {
        mode: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)) for mode, rs in runs.items()
    }
    (t_off, m_off), (t_on, m_on) = medians["off"], medians["on"]
    what = "peak allocated" if device == "cuda" else "saved activations + grads + AdamW state"
    print(
        f"actor step on {device}, {images} images of 16 x 16 patches, 4-block tower (hidden 128), medians of {repeats}:"
    )
    print(f"  freeze off (verl): {t_off * 1e3:7.1f} ms, {m_off / 2**20:7.1f} MiB {what}")
    print(f"  freeze on (plugin): {t_on * 1e3:6.1f} ms, {m_on / 2**20:7.1f} MiB ({t_off / t_on:.2f}x faster, "
          f"{1 - m_on / m_off:.0%} less memory)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tower_30b_a3b()
    actor_step(1 if args.smoke else args.images, 1 if args.smoke else args.repeats)


if __name__ == "__main__":
    main()
