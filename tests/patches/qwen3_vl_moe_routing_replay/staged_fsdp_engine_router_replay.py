"""Routing replay (R3) on verl's FSDP engine: two gloo ranks, FSDP2, each with its own samples, a tiny Qwen3-VL-MoE
built from a config (random weights) by the engine's own ``_build_model_optimizer`` after verl's
``apply_monkey_patch``. The rollout's record is the model's own routes with every other token's experts moved, packed
as verl's agent loop packs vLLM's ``routed_experts`` (zeros, no route, on each sample's last token, which the rollout
never runs). With ``router_replay.mode=R3`` the engine's ``compute_log_prob`` pass (``forward_backward_batch``,
forward only) routes every recorded token as the record says, read from hooks on the experts, and its log-probs
differ from free routing's. Before this change the FSDP engine ignored the setting and routed by itself."""

import datetime
import inspect
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tensordict import NonTensorStack, TensorDict
from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
from verl.models.transformers.monkey_patch import apply_monkey_patch
from verl.utils import fsdp_utils
from verl.utils import tensordict_utils as tu
from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig
from verl.workers.config.actor import FSDPActorConfig
from verl.workers.config.engine import EngineRouterReplayConfig
from verl.workers.engine.fsdp import transformer_impl
from verl.workers.engine.fsdp import utils as engine_utils
from verl.workers.utils.padding import left_right_2_no_padding

WORLD = 2
TIMEOUT = 300  # seconds for the two ranks together
EXPERTS, TOP_K, LAYERS = 8, 2, 2
TEXT = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=LAYERS,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    num_experts=EXPERTS,
    num_experts_per_tok=TOP_K,
    decoder_sparse_step=1,
    rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
)
VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=32,
    num_position_embeddings=16,
    deepstack_visual_indexes=[0],
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
)


def on_cpu():
    for module in (transformer_impl, fsdp_utils):
        module.get_device_id = lambda: "cpu"
    engine_utils.get_device_name = lambda: "cpu"
    transformer_impl.log_gpu_memory_usage = lambda *args, **kwargs: None


def tiny_model():
    torch.manual_seed(0)  # the same weights on every rank and for every engine
    model = Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(text_config=TEXT, vision_config=VISION))
    apply_monkey_patch(model=model, use_remove_padding=True, ulysses_sp_size=1)  # as the engine's _build_module
    return model


def built_engine(mode: str):
    """verl's FSDP engine (FSDP2, fp32) for an actor whose ``router_replay.mode`` is ``mode``."""
    model = tiny_model()
    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    engine_config = FSDPEngineConfig(
        strategy="fsdp2",
        mixed_precision=fp32,
        use_torch_compile=False,
        router_replay=EngineRouterReplayConfig(mode=mode),
    )
    actor = FSDPActorConfig(
        strategy="fsdp2",
        ppo_mini_batch_size=2,
        ppo_micro_batch_size_per_gpu=2,
        rollout_n=1,
        use_remove_padding=True,
        fsdp_config=engine_config,
    )
    model_config = SimpleNamespace(
        hf_config=model.config,
        lora_rank=0,
        use_remove_padding=True,
        enable_gradient_checkpointing=False,
        enable_activation_offload=False,
    )
    optimizer = FSDPOptimizerConfig(lr=1e-3, total_training_steps=1, lr_warmup_steps=0)
    engine = transformer_impl.FSDPEngineWithLMHead(model_config, actor.engine, optimizer, SimpleNamespace())
    engine._build_module = lambda: model
    engine._build_model_optimizer()
    engine.module.eval()
    return engine


def samples(rank: int):
    """Two left-padded prompts with full responses, different on each rank."""
    generator = torch.Generator().manual_seed(10 + rank)
    prompts = [5 + rank, 3]
    width, response = max(prompts), 4
    input_ids = torch.zeros(2, width + response, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, length in enumerate(prompts):
        input_ids[i, width - length :] = torch.randint(1, TEXT["vocab_size"], (length + response,), generator=generator)
        attention_mask[i, width - length :] = 1
    text = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": text.unsqueeze(1).expand(-1, 4, -1).clone(),  # text positions and Qwen3-VL's three mrope
        "response_mask": torch.ones(2, response, dtype=torch.long),
    }


def engine_data(batch: dict, record: torch.Tensor | None):
    """The batch as verl's trainer hands it to the engine's ``compute_log_prob``: nested by
    ``left_right_2_no_padding`` (the record with it)."""
    tensors = dict(batch, **({"routed_experts": record} if record is not None else {}))
    data = left_right_2_no_padding(TensorDict(tensors, batch_size=[2]))
    data["multi_modal_inputs"] = NonTensorStack({}, {})
    settings = dict(
        temperature=1.0,
        calculate_entropy=False,
        use_remove_padding=True,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=2,
        max_token_len_per_gpu=64,
    )
    for key, value in settings.items():
        tu.assign_non_tensor_data(data, key, value)
    return data


def routed_pass(engine, data) -> tuple[torch.Tensor, torch.Tensor]:
    """(the experts each packed token went to, (tokens, layers, top_k); the packed log-probs) of one forward-only
    pass, read from hooks on the experts modules."""
    chosen = [[] for _ in range(LAYERS)]
    handles = []
    for layer, block in enumerate(engine.module.model.language_model.layers):
        experts = block.mlp.experts
        position = list(inspect.signature(type(experts).forward).parameters).index("top_k_index") - 1
        handles.append(
            experts.register_forward_pre_hook(
                lambda _, args, layer=layer, position=position: chosen[layer].append(args[position].detach())
            )
        )
    log_probs = []

    def loss_function(model_output, data, dp_group):
        log_probs.append(model_output["log_probs"].values().detach())
        return model_output["log_probs"].values().sum() * 0, {}

    try:
        engine.forward_backward_batch(data, loss_function, forward_only=True)
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack([torch.cat(calls) for calls in chosen], dim=1), torch.cat(log_probs)


def rollout_record(free: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The rollout's routes, as the agent loop packs them: (bsz, seqlen, layers, top_k) int16, every other real
    token's experts moved by one (a rollout that routed unlike the trainer), zeros on padding and last tokens."""
    moved = free.clone()
    moved[::2] = (moved[::2] + 1) % EXPERTS
    record = torch.zeros(*mask.shape, LAYERS, TOP_K, dtype=torch.int16)
    record[mask.bool()] = moved.to(torch.int16)
    last = mask.shape[1] - 1 - mask.flip(-1).int().argmax(-1)
    record[torch.arange(mask.shape[0]), last] = 0
    return record


def replay_on_rank(rank: int, rendezvous: str, results) -> None:
    on_cpu()
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=TIMEOUT // 2),
    )
    try:
        batch = samples(rank)
        mask = batch["attention_mask"]
        free, free_log_probs = routed_pass(built_engine("disabled"), engine_data(batch, None))
        record = rollout_record(free, mask)
        replayed, replay_log_probs = routed_pass(built_engine("R3"), engine_data(batch, record))
        routed = record[mask.bool()].long()
        has_route = routed[..., 0] != routed[..., 1]  # zeros (no route) on each sample's last token
        results[rank] = {
            "moved": bool((routed[has_route] != free[has_route]).any()),
            "replayed": bool(torch.equal(replayed[has_route], routed[has_route])),
            "log_prob_change": float((replay_log_probs - free_log_probs).abs().max()),
        }
    finally:
        dist.destroy_process_group()


def test_r3_replays_the_rollout_routes_on_two_fsdp2_ranks(tmp_path):
    results = mp.Manager().dict()
    context = mp.spawn(replay_on_rank, args=(str(tmp_path / "rendezvous"), results), nprocs=WORLD, join=False)
    deadline = time.monotonic() + TIMEOUT
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the ranks did not finish in {TIMEOUT} s")
    for rank in range(WORLD):
        assert results[rank]["moved"], "the record must route some tokens unlike the model"
        assert results[rank]["replayed"], f"rank {rank}: the engine did not route as the rollout's record says"
        assert results[rank]["log_prob_change"] > 1e-4, "replayed routes must change the log-probs"
