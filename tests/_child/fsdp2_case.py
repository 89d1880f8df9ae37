"""Two FSDP2 ranks on the CPU (gloo) run a vision tower with ``pos_embed`` sharded on its own, as verl's FSDP2
wrapping does; prints, per rank, whether the output and the table's gradient match the unsharded upstream tower."""

import json
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def first(out):
    # The merged patch embeddings, whatever this transformers' vision forward returns them in.
    if isinstance(out, tuple):
        return out[0]
    return out.pooler_output if getattr(out, "pooler_output", None) is not None else out.last_hidden_state


def worker(rank, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    from verl_qwen3vl_plugin.models.qwen3_vl import fast_pos_embed_interpolate
    from verl_qwen3vl_plugin.selftest.tiny_models import VISION, pixel_values

    def tower():
        torch.manual_seed(0)
        model = Qwen3VLVisionModel(Qwen3VLVisionConfig(**VISION))
        with torch.no_grad():
            model.pos_embed.weight.normal_(generator=torch.Generator().manual_seed(1))
        return model

    grid = torch.tensor([[1, 4, 6], [2, 8, 8], [1, 2, 2]])
    pixels = pixel_values(grid)
    reference = tower()  # unsharded, upstream's own method
    expected = first(reference(pixels, grid_thw=grid))
    expected.square().sum().backward()

    Qwen3VLVisionModel.fast_pos_embed_interpolate = fast_pos_embed_interpolate
    model = tower()
    mesh = init_device_mesh("cpu", (2,))
    fully_shard(model.pos_embed, mesh=mesh)  # verl's FSDP2 wrapping gives nn.Embedding its own unit
    fully_shard(model, mesh=mesh)
    out = first(model(pixels, grid_thw=grid))
    out.square().sum().backward()
    grad = model.pos_embed.weight.grad.full_tensor()
    queue.put(
        {
            "rank": rank,
            "sharded": type(model.pos_embed.weight).__name__,
            "equal": bool(torch.equal(out, expected)),
            "grad_close": bool(torch.allclose(grad, reference.pos_embed.weight.grad, rtol=1e-5, atol=1e-6)),
        }
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    print(json.dumps(sorted(results, key=lambda r: r["rank"])))
