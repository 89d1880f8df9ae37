"""verl's own actor forward with Ulysses SP = 2 on two CPU ranks (gloo), against SP = 1 on the same batch and weights.

    ulysses_actor.py dense|moe CASE[,CASE...] none|fsdp2|fsdp2_offload [shuffled]

On each rank: ``DataParallelPPOActor._forward_micro_batch`` with ``use_remove_padding=True`` after verl's
``apply_monkey_patch(model, ulysses_sp_size=2)``, first with no Ulysses group (SP = 1), then with
``set_ulysses_sequence_parallel_group`` on both ranks (SP = 2). Loss: fixed random weights on the log-probs and
entropies. Prints one JSON list (per rank, per case): the largest differences of log-probs, entropies and gradients
(averaged over the ranks, as FSDP reduces them), and the patch rows that entered ``patch_embed`` in each tower call.
``shuffled``: the plugin's gather returns the ranks' blocks in reverse order (the negative control).

CPU stand-ins, kept in this test: an exact varlen attention for transformers' ``_flash_attention_forward`` (flash_attn
does not install here), installed where verl's Ulysses attention wrapper calls it, so verl's all-to-all and slicing
run unmodified; verl's pure-torch padding helpers (``verl.utils.npu_flash_attn_utils``, with ``einops``) where verl's
``attention_utils`` would import ``flash_attn.bert_padding``; verl's ``get_device_id`` (it asks CUDA).
"""

import json
import os
import socket
import sys
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

# A micro-batch per case: each sample's images as (t, h, w) grids, videos marked "v"; every tensor is seeded.
CASES = {
    "mixed": [[(1, 4, 6)], [(1, 2, 2), (1, 8, 8)], [(1, 4, 4)]],  # SP boundary inside the 8 x 8 image
    "fewer_images": [[(1, 4, 4)], []],
    "large": [[(1, 2, 2)], [(1, 16, 16), (1, 2, 4)], [(1, 4, 2)]],
    "video": [[("v", 2, 4, 4)], [(1, 4, 4)]],
    "text_only": [[], []],
}
RESPONSE = 5


def varlen_attention(q, k, v, attention_mask, query_length, *args, position_ids=None, is_causal=True, **kwargs):
    """Exact attention over the packed sequences flash_attn's varlen kernel would see, (1, seq, heads, dim)."""
    if kwargs.get("cu_seq_lens_q") is not None:
        bounds = kwargs["cu_seq_lens_q"].tolist()
    elif position_ids is not None:
        starts = (position_ids.flatten() == 0).nonzero().flatten().tolist()
        bounds = starts + [q.shape[1]]
    else:
        bounds = [0, q.shape[1]]
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    scale = kwargs.get("softmax_scale")
    out = [
        F.scaled_dot_product_attention(
            q[:, s:e].transpose(1, 2), k[:, s:e].transpose(1, 2), v[:, s:e].transpose(1, 2),
            is_causal=is_causal, scale=scale,
        ).transpose(1, 2)
        for s, e in zip(bounds[:-1], bounds[1:], strict=True) if e > s
    ]  # fmt: skip
    return torch.cat(out, dim=1)


def build_model(kind):
    from verl_qwen3vl_plugin.selftest.tiny_models import randomize, tiny_qwen3_vl, tiny_qwen3_vl_moe

    model = randomize(tiny_qwen3_vl() if kind == "dense" else tiny_qwen3_vl_moe(), seed=0)
    for config in (model.config, model.config.text_config, model.config.vision_config):
        config._attn_implementation = "flash_attention_2"  # verl's Ulysses path: served by varlen_attention
    return model


def micro_batch(model, samples):
    from verl_qwen3vl_plugin.selftest.tiny_models import IMAGE_TOKEN, VIDEO_TOKEN, VISION, VISION_START, pixel_values

    merge = VISION["spatial_merge_size"] ** 2
    generator = torch.Generator().manual_seed(3)
    rows, mm = [], []
    for i, items in enumerate(samples):
        ids, images, videos = [], [], []
        for item in items:
            if item[0] == "v":  # a video: one vision segment per temporal patch, as Qwen3-VL's processor writes
                grid = torch.tensor([item[1:]])
                for _ in range(item[1]):
                    ids += [VISION_START] + [VIDEO_TOKEN] * (item[2] * item[3] // merge)
                videos.append(grid)
            else:
                grid = torch.tensor([item])
                ids += [VISION_START] + [IMAGE_TOKEN] * (int(grid.prod()) // merge)
                images.append(grid)
        ids += torch.randint(1, 90, (4 + i,), generator=generator).tolist()
        rows.append(ids)
        inputs = {}
        if images:
            grid = torch.cat(images)
            inputs.update(pixel_values=pixel_values(grid, seed=i), image_grid_thw=grid)
        if videos:
            grid = torch.cat(videos)
            inputs.update(pixel_values_videos=pixel_values(grid, seed=10 + i), video_grid_thw=grid)
        mm.append(inputs or None)
    prompt = max(map(len, rows))
    bsz = len(rows)
    responses = torch.randint(1, 90, (bsz, RESPONSE), generator=generator)
    input_ids = torch.zeros(bsz, prompt + RESPONSE, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(rows):  # prompts left-padded, as verl's rollout returns them
        input_ids[i, prompt - len(ids) : prompt] = torch.tensor(ids)
        attention_mask[i, prompt - len(ids) :] = 1
    input_ids[:, prompt:] = responses
    # verl's own mrope positions, per sample, as its dataset computes them for Qwen3-VL
    from verl.models.transformers.qwen3_vl import get_rope_index

    processor = SimpleNamespace(
        image_processor=SimpleNamespace(merge_size=VISION["spatial_merge_size"]),
        image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
    )  # fmt: skip
    vision = torch.stack([
        get_rope_index(
            processor, input_ids[i], (inputs or {}).get("image_grid_thw"), (inputs or {}).get("video_grid_thw"),
            attention_mask[i],
        )
        for i, inputs in enumerate(mm)
    ])  # fmt: skip
    text = (attention_mask.cumsum(-1) - 1).clamp(min=0).unsqueeze(1)
    position_ids = torch.cat([text, vision], dim=1)  # (bsz, 4, seq), as verl's dataset
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "responses": responses,
        "multi_modal_inputs": np.array(mm, dtype=object),
    }


def boundary_inside_image(batch, size):
    """Whether one of verl's SP slice boundaries of the packed sequence falls inside an image's tokens."""
    from verl_qwen3vl_plugin.selftest.tiny_models import IMAGE_TOKEN, VIDEO_TOKEN

    packed = batch["input_ids"][batch["attention_mask"].bool()]
    local = -(-packed.numel() // size)
    vision = (packed == IMAGE_TOKEN) | (packed == VIDEO_TOKEN)
    return any(bool(vision[b - 1] and vision[b]) for b in range(local, packed.numel(), local))


def actor_for(model, sp):
    from omegaconf import OmegaConf
    from verl.workers.actor import dp_actor  # verl 0.7.x
    from verl.workers.config.actor import FSDPActorConfig

    config = FSDPActorConfig(
        strategy="fsdp",
        ppo_mini_batch_size=2,
        ppo_micro_batch_size_per_gpu=2,
        use_dynamic_bsz=False,
        rollout_n=1,
        use_remove_padding=True,
        fsdp_config=OmegaConf.create({"dtype": "float32"}),  # the actor sets its SP size on it
        use_torch_compile=False,
        ulysses_sequence_parallel_size=sp,
        entropy_coeff=0.0,
    )
    return dp_actor.DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=0.0))


def engine_forward(model, batch, sp):
    """What verl 0.8/0.9's ``FSDPEngineWithLMHead`` does around the model with remove-padding, from verl's own helpers.

    ``prepare_model_inputs``: pack, roll, ``ulysses_pad`` (a VLM is sliced at the language model, not here) and
    slice the rolled labels; ``prepare_model_outputs``: log-probs and entropy of the local slice, gathered over SP.
    """
    from verl.utils.model import extract_multi_modal_inputs
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits
    from verl.utils.ulysses import gather_outputs_and_unpad, ulysses_pad, ulysses_pad_and_slice_inputs

    mask = batch["attention_mask"].bool()
    ids = batch["input_ids"][mask].unsqueeze(0)  # (1, nnz)
    positions = batch["position_ids"].transpose(0, 1)[:, mask].unsqueeze(1)  # (4, 1, nnz)
    rolled = torch.roll(ids, shifts=-1, dims=1)
    pad = 0
    if sp > 1:
        ids, positions, pad = ulysses_pad(ids, position_ids_rmpad=positions, sp_size=sp)
        rolled, _, _ = ulysses_pad_and_slice_inputs(rolled, position_ids_rmpad=None, sp_size=sp)
    inputs = extract_multi_modal_inputs(batch["multi_modal_inputs"])
    logits = model(input_ids=ids, attention_mask=None, position_ids=positions, **inputs, use_cache=False).logits
    logits = logits.squeeze(0)
    log_probs = logprobs_from_logits(logits, rolled.squeeze(0), inplace_backward=False)
    entropy = entropy_from_logits(logits)
    if sp > 1:
        log_probs = gather_outputs_and_unpad(log_probs, gather_dim=0, unpad_dim=0, padding_size=pad)
        entropy = gather_outputs_and_unpad(entropy, gather_dim=0, unpad_dim=0, padding_size=pad)
    results = []
    for packed in (log_probs, entropy):
        padded = packed.new_zeros(mask.shape).masked_scatter(mask, packed)
        results.append(padded[:, -RESPONSE - 1 : -1])
    return results


def full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def run_pass(model, batch, sp, counts):
    from verl.utils.ulysses import set_ulysses_sequence_parallel_group

    set_ulysses_sequence_parallel_group(dist.group.WORLD if sp > 1 else None)
    model.zero_grad(set_to_none=True)
    counts.clear()
    try:
        actor = actor_for(model, sp)
    except ImportError:  # verl >= 0.8: no DataParallelPPOActor
        log_probs, entropy = engine_forward(model, batch, sp)
    else:
        out = actor._forward_micro_batch(batch, temperature=1.0, calculate_entropy=True)
        # verl 0.7.1 returns a dict, 0.7.0 the tuple (entropy, log_probs)
        log_probs, entropy = (out["log_probs"], out["entropys"]) if isinstance(out, dict) else out[::-1]
    generator = torch.Generator().manual_seed(5)
    loss = (log_probs * torch.randn(log_probs.shape, generator=generator)).sum()
    (loss + (entropy * torch.randn(entropy.shape, generator=generator)).sum()).backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = full(p.grad) if p.grad is not None else torch.zeros(p.shape)
        if sp > 1 and not hasattr(p, "full_tensor"):  # FSDP averages over the ranks; plain modules do it here
            grad = grad.clone()
            dist.all_reduce(grad)
            grad /= dist.get_world_size()
        grads[name] = grad
    set_ulysses_sequence_parallel_group(None)
    return log_probs.detach(), entropy.detach(), grads, list(counts)


def worker(rank, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        queue.put(run_rank(rank, *args))
    except Exception as exc:
        import traceback

        queue.put({"rank": rank, "error": traceback.format_exc()[-3000:] or repr(exc)})
    finally:
        dist.destroy_process_group()


def run_rank(rank, kind, cases, fsdp, shuffled):
    import verl  # noqa: F401  (the plugin activates here, as in a user's worker)
    from verl.models.transformers import monkey_patch
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.utils import attention_utils, npu_flash_attn_utils

    from verl_qwen3vl_plugin import patch_statuses
    from verl_qwen3vl_plugin.models import vision_dp

    try:
        from verl.workers.actor import dp_actor
    except ImportError:
        pass
    else:
        dp_actor.get_device_id = lambda: "cpu"
    monkey_patch._flash_attention_forward = varlen_attention
    padding = tuple(
        getattr(npu_flash_attn_utils, name) for name in ("index_first_axis", "pad_input", "rearrange", "unpad_input")
    )
    attention_utils._get_attention_functions = lambda: padding
    if shuffled:
        gather = vision_dp.gather_rows

        def reversed_gather(local, rows, rank, group):
            blocks = gather(local, rows, rank, group).split(rows)
            return torch.cat(blocks[::-1])

        vision_dp.gather_rows = reversed_gather
    model = build_model(kind)
    apply_monkey_patch(model, ulysses_sp_size=2, use_remove_padding=True, use_fused_kernels=False)  # once: it wraps
    if fsdp != "none":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        mesh = init_device_mesh("cpu", (2,))
        offload = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if fsdp == "fsdp2_offload" else {}
        for block in [*model.model.visual.blocks, *model.model.language_model.layers]:
            fully_shard(block, mesh=mesh, **offload)
        fully_shard(model, mesh=mesh, **offload)
    counts = []
    model.model.visual.patch_embed.register_forward_pre_hook(lambda _, a: counts.append(a[0].shape[0]))
    applied = any(s.patch == "qwen3_vl_vision_dp" and s.status == "applied" for s in patch_statuses())
    results = {"rank": rank, "vision_dp_applied": applied, "tower": type(model.model.visual).forward.__module__}
    for case in cases.split(","):
        batch = micro_batch(model, CASES[case])
        ref_lp, ref_ent, ref_grads, ref_counts = run_pass(model, batch, 1, counts)
        lp, ent, grads, sp_counts = run_pass(model, batch, 2, counts)
        grad_err = max(float((grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-12)) for n, g in ref_grads.items())
        results[case] = {
            "log_prob_diff": float((lp - ref_lp).abs().max()),
            "entropy_diff": float((ent - ref_ent).abs().max()),
            "grad_rel_diff": grad_err,
            "sp1_patch_rows": ref_counts,
            "sp2_patch_rows": sp_counts,
            "boundary_inside_image": boundary_inside_image(batch, 2),
        }
    return results


if __name__ == "__main__":
    kind, case, fsdp, *rest = sys.argv[1:]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    args = (kind, case, fsdp, rest == ["shuffled"])
    procs = [ctx.Process(target=worker, args=(rank, port, args, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    results = sorted((queue.get(timeout=600) for _ in procs), key=lambda r: r["rank"])
    for proc in procs:
        proc.join(timeout=60)
    print(json.dumps(results))
