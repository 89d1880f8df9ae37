"""Two FSDP2 ranks on the CPU (gloo) run a vision tower with ``pos_embed`` sharded on its own, as verl's FSDP2
wrapping does; prints, per rank, whether the output and the table's gradient match the unsharded upstream tower."""

import json

import torch

from verl_qwen3vl_plugin.selftest.ranks import on_two_ranks


def first(out):
    # The merged patch embeddings, whatever this transformers' vision forward returns them in.
    if isinstance(out, tuple):
        return out[0]
    return out.pooler_output if getattr(out, "pooler_output", None) is not None else out.last_hidden_state


def worker(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    from verl_qwen3vl_plugin.patches.qwen3_vl_pos_embed.replacement import fast_pos_embed_interpolate
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
    return {
        "rank": rank,
        "sharded": type(model.pos_embed.weight).__name__,
        "equal": bool(torch.equal(out, expected)),
        "grad_close": bool(torch.allclose(grad, reference.pos_embed.weight.grad, rtol=1e-5, atol=1e-6)),
    }


if __name__ == "__main__":
    print(json.dumps(on_two_ranks(worker, timeout=240)))
