"""verl's Ulysses path on CPU ranks, the parts only the tests and benchmarks use: FSDP2 sharding as verl wraps a VLM,
where verl's SP slices cut a packed sequence, and one log-prob forward through verl's own code at an SP size.

No self-test reaches these, so they stay out of the wheel; the stand-ins, micro-batches and verl's actor and engine
they build on are the self-tests' too (``verl_qwen3vl_plugin/selftest/ulysses.py``). Imported by the sibling child
scripts (``from ulysses_ranks import ...``) and the benchmarks, not as ``tests.``: verl's wheel installs a top-level
``tests`` package of its own, which shadows this repository's outside pytest. Not a child of its own.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from verl_qwen3vl_plugin.selftest.ulysses import actor_for, engine_forward


def shard(model: torch.nn.Module, offload: bool = False) -> torch.nn.Module:
    """FSDP2 over the world (CPU mesh) as verl wraps a VLM: each vision block, each decoder layer, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    options = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
    for block in [*model.model.visual.blocks, *model.model.language_model.layers]:
        fully_shard(block, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return model


def boundary_inside_image(batch: dict, size: int) -> bool:
    """Whether one of verl's SP slice boundaries of the packed sequence falls inside an image's tokens."""
    from verl_qwen3vl_plugin.selftest.tiny_models import IMAGE_TOKEN, VIDEO_TOKEN

    packed = batch["input_ids"][batch["attention_mask"].bool()]
    local = -(-packed.numel() // size)
    vision = (packed == IMAGE_TOKEN) | (packed == VIDEO_TOKEN)
    return any(bool(vision[b - 1] and vision[b]) for b in range(local, packed.numel(), local))


def log_prob_forward(model: torch.nn.Module, batch: dict, sp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Response log-probs and entropies through verl's code, with its Ulysses group set to the world when sp > 1.

    verl 0.7.x: ``DataParallelPPOActor._forward_micro_batch``; verl >= 0.8 (no such actor): the engine's
    ``forward_step`` (``engine_forward``).
    """
    from verl.utils.ulysses import set_ulysses_sequence_parallel_group

    set_ulysses_sequence_parallel_group(dist.group.WORLD if sp > 1 else None)
    try:
        try:
            actor = actor_for(model, sp)
        except ImportError:
            return engine_forward(model, batch, sp)
        out = actor._forward_micro_batch(batch, temperature=1.0, calculate_entropy=True)
        # verl 0.7.1 returns a dict, 0.7.0 the tuple (entropy, log_probs)
        return (out["log_probs"], out["entropys"]) if isinstance(out, dict) else out[::-1]
    finally:
        set_ulysses_sequence_parallel_group(None)


def error_of(call) -> str | None:
    """The exception ``call`` raised, as one line; None where it returned."""
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def one_rank_group() -> None:
    """A gloo group of this process alone, on a free local port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
