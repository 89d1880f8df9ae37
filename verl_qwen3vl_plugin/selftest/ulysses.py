"""verl's Ulysses path for Qwen3-VL and Qwen3.5 on CPU ranks: the stand-ins it needs there, tiny micro-batches with
images as verl's trainer hands them over, and verl's own actor (0.7) or FSDP engine (>= 0.8) around a tiny model.
The routing-replay, packed delta-net, single-vision-call and dynamic-batch self-tests run on these; what only the
tests and benchmarks use (FSDP2 sharding, the log-prob forward at an SP size) is in ``tests/_child/ulysses_ranks.py``.

The stand-ins replace only what cannot run on a CPU, and only in the process that calls ``install_cpu_stand_ins``:
an exact varlen attention for transformers' ``_flash_attention_forward`` (flash_attn does not install here),
installed where verl's Ulysses attention wrapper calls it, so verl's all-to-all and slicing run unmodified; verl's
pure-torch padding helpers (``verl.utils.npu_flash_attn_utils``, with ``einops``) where verl's ``attention_utils``
would import ``flash_attn.bert_padding``; and verl's ``get_device_id`` (it asks CUDA). Qwen3.5's gated delta-net
layers need none: they run transformers' torch fallback, as on Ascend, kept apart by ``qwen3_5_packed_delta_net``.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

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


def install_cpu_stand_ins() -> None:
    from verl.models.transformers import monkey_patch
    from verl.utils import attention_utils, npu_flash_attn_utils

    try:
        from verl.workers.actor import dp_actor
    except ImportError:  # verl >= 0.8
        pass
    else:
        dp_actor.get_device_id = lambda: "cpu"
    monkey_patch._flash_attention_forward = varlen_attention
    padding = tuple(
        getattr(npu_flash_attn_utils, name) for name in ("index_first_axis", "pad_input", "rearrange", "unpad_input")
    )
    attention_utils._get_attention_functions = lambda: padding


def build_model(kind: str, text: dict | None = None, **vision) -> torch.nn.Module:
    """A seeded tiny model set up for verl's flash-attention path: Qwen3-VL (``dense``), Qwen3-VL-MoE (``moe``),
    Qwen3.5 (``qwen3_5``) or Qwen3.5-MoE (``qwen3_5_moe``); ``text`` overrides the text config."""
    from verl_qwen3vl_plugin.selftest.tiny_models import randomize, tiny_qwen3_5, tiny_qwen3_vl, tiny_qwen3_vl_moe

    if kind.startswith("qwen3_5"):
        built = tiny_qwen3_5(moe=kind == "qwen3_5_moe", **(text or {}))
    else:
        built = tiny_qwen3_vl(**vision) if kind == "dense" else tiny_qwen3_vl_moe(vision=vision, **(text or {}))
    model = randomize(built, seed=0)
    for config in (model.config, model.config.text_config, model.config.vision_config):
        config._attn_implementation = "flash_attention_2"  # verl's Ulysses path: served by varlen_attention
    return model


def micro_batch(samples: list[list[tuple]]) -> dict:
    """A verl micro-batch: per sample its images as (t, h, w) grids (videos as ("v", t, h, w)), then text."""
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


def actor_for(model: torch.nn.Module, sp: int, dtype: str = "float32", **config):
    """verl 0.7.x's ``DataParallelPPOActor`` on ``model``: one micro-batch of 2, remove-padding unless ``config``
    says otherwise, a no-op optimizer (the tests compare passes, not steps)."""
    from omegaconf import OmegaConf
    from verl.workers.actor import dp_actor  # verl 0.7.x
    from verl.workers.config.actor import FSDPActorConfig

    config = FSDPActorConfig(
        **{
            "strategy": "fsdp",
            "ppo_mini_batch_size": 2,
            "ppo_micro_batch_size_per_gpu": 2,
            "use_dynamic_bsz": False,
            "rollout_n": 1,
            "use_remove_padding": True,
            "fsdp_config": OmegaConf.create({"dtype": dtype}),  # the actor sets its SP size on it
            "use_torch_compile": False,
            "ulysses_sequence_parallel_size": sp,
            "entropy_coeff": 0.0,
            **config,
        }
    )
    return dp_actor.DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=0.0))


def engine_for(model: torch.nn.Module, sp: int, **config):
    """verl >= 0.8's ``FSDPEngineWithLMHead`` on ``model``, an object holding only what its forward reads: its
    ``forward_step`` and ``forward_backward_batch`` run as verl's (``config``: more engine-config fields)."""
    from contextlib import nullcontext

    from verl.utils.torch_functional import entropy_from_logits
    from verl.workers.engine.fsdp import transformer_impl

    transformer_impl.get_device_id = lambda: "cpu"
    engine = transformer_impl.FSDPEngineWithLMHead.__new__(transformer_impl.FSDPEngineWithLMHead)
    engine.module, engine.use_ulysses_sp, engine.ulysses_sequence_parallel_size = model, sp > 1, sp
    engine.pad_to_length, engine._autocast_dtype = False, torch.float32
    # verl >= 0.9 sets this while building the model: a forward that takes cu_seqlens (Qwen3.5's, for its gated
    # delta-net layers) gets the packed sequences' boundaries.
    engine.pass_packed_cu_seqlens = "cu_seqlens" in inspect.signature(model.forward).parameters
    engine.engine_config = SimpleNamespace(
        entropy_checkpointing=False, entropy_from_logits_with_chunking=False, **config
    )
    engine.compute_entropy_from_logits = entropy_from_logits
    engine.get_data_parallel_group = lambda: None
    engine.get_data_parallel_size = lambda: 1
    engine._gradient_sync_context = lambda **_: nullcontext()
    return engine


def built_engine(model: torch.nn.Module, strategy: str, freeze: bool, lora: bool = False):
    """verl's own ``FSDPEngineWithLMHead`` for an actor with ``freeze_vision_tower=freeze``, built by verl's
    ``_build_model_optimizer`` (LoRA, FSDP wrapping, AdamW) around ``model``: only the hub download is replaced. fp32
    throughout, so no change is lost to rounding."""
    from verl.utils import fsdp_utils
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig
    from verl.workers.config.actor import FSDPActorConfig
    from verl.workers.engine.fsdp import transformer_impl
    from verl.workers.engine.fsdp import utils as engine_utils

    for module in (transformer_impl, fsdp_utils):
        module.get_device_id = lambda: "cpu"
    engine_utils.get_device_name = lambda: "cpu"
    transformer_impl.log_gpu_memory_usage = lambda *args, **kwargs: None
    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    engine_config = FSDPEngineConfig(strategy=strategy, mixed_precision=fp32, use_torch_compile=False)
    actor = FSDPActorConfig(
        strategy=strategy, ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2, rollout_n=1,
        freeze_vision_tower=freeze, fsdp_config=engine_config, use_remove_padding=True,
    )  # fmt: skip
    model_config = SimpleNamespace(
        use_remove_padding=True, lora_rank=8 if lora else 0, lora_alpha=16, target_modules="all-linear",
        exclude_modules=None, target_parameters=None, lora_adapter_path=None, hf_config=model.config,
        enable_gradient_checkpointing=False, enable_activation_offload=False, use_fused_kernels=False,
        fused_kernel_options=None, use_liger=False, model_type="language_model",
    )  # fmt: skip
    optim = FSDPOptimizerConfig(lr=1e-2, total_training_steps=2, lr_warmup_steps=0)
    engine = transformer_impl.FSDPEngineWithLMHead(model_config, actor.engine, optim, SimpleNamespace())
    engine._build_module = lambda: model  # the hub download, and nothing else, replaced
    engine._build_model_optimizer()
    return engine


def engine_batch(batch: dict, **tensors: torch.Tensor):
    """A batch as verl's trainer hands it to the engine: through ``left_right_2_no_padding`` (which nests a
    ``routed_experts`` record like ``input_ids``), with its images and the non-tensor settings a forward reads."""
    from tensordict import NonTensorStack, TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    padded = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids")}
    padded["response_mask"] = torch.ones_like(batch["responses"])
    data = left_right_2_no_padding(TensorDict({**padded, **tensors}, batch_size=[batch["input_ids"].shape[0]]))
    data["multi_modal_inputs"] = NonTensorStack(*[inputs or {} for inputs in batch["multi_modal_inputs"]])
    for key, value in (("temperature", 1.0), ("calculate_entropy", True), ("use_remove_padding", True)):
        tu.assign_non_tensor_data(data, key, value)
    return data


def engine_forward(model: torch.nn.Module, batch: dict, sp: int) -> list[torch.Tensor]:
    """verl >= 0.8: ``FSDPEngineWithLMHead.forward_step`` itself (``engine_for``). The loss function verl calls
    captures the model output (log-probs and entropies of every packed token, still in the graph) and returns a zero
    loss."""
    captured = {}

    def loss_function(model_output, data, dp_group):
        captured.update(model_output)
        return model_output["log_probs"].values().sum() * 0, {}

    engine_for(model, sp).forward_step(engine_batch(batch), loss_function=loss_function, forward_only=False)
    return [captured["log_probs"].values(), captured["entropy"].values()]
