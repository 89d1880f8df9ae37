"""``actor.freeze_vision_tower`` reaches verl's FSDP engine: a tiny Qwen3-VL built by the engine's own
``_build_model_optimizer`` (FSDP2) has its vision tower frozen, before FSDP wraps it and verl builds the optimizer,
while the language model stays trainable. Under FSDP1, verl's wrap policy gives a frozen tower a unit of its own:
FSDP1 (without ``use_orig_params``) refuses a flat parameter that mixes frozen and trainable ones. One CPU process in a
gloo group of one; verl's device lookups answer ``cpu``; only the hub download is replaced. Before the fix the engine
never read the setting."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
from verl.utils import fsdp_utils
from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig
from verl.workers.config.actor import FSDPActorConfig
from verl.workers.engine.fsdp import transformer_impl
from verl.workers.engine.fsdp import utils as engine_utils

TEXT = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
)
VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=32,
    num_position_embeddings=16,
    deepstack_visual_indexes=[1],
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
)


@pytest.fixture
def cpu_group(tmp_path, monkeypatch):
    for module in (transformer_impl, fsdp_utils):
        monkeypatch.setattr(module, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(engine_utils, "get_device_name", lambda: "cpu")
    monkeypatch.setattr(transformer_impl, "log_gpu_memory_usage", lambda *args, **kwargs: None)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def tiny_qwen3_vl() -> Qwen3VLForConditionalGeneration:
    torch.manual_seed(0)
    return Qwen3VLForConditionalGeneration(Qwen3VLConfig(text_config=TEXT, vision_config=VISION))


def built_engine(strategy: str):
    """verl's FSDP engine for an actor with ``freeze_vision_tower=True``, built around a tiny Qwen3-VL."""
    model = tiny_qwen3_vl()
    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    engine_config = FSDPEngineConfig(strategy=strategy, mixed_precision=fp32, use_torch_compile=False)
    actor = FSDPActorConfig(
        strategy=strategy,
        ppo_mini_batch_size=2,
        ppo_micro_batch_size_per_gpu=2,
        rollout_n=1,
        use_remove_padding=True,
        freeze_vision_tower=True,
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
    return engine


def test_fsdp2_engine_freezes_the_vision_tower(cpu_group):
    engine = built_engine("fsdp2")
    tower, language = [], []
    for name, param in engine.module.named_parameters():
        (tower if name.startswith("model.visual.") else language).append(param)
    assert tower and language
    assert not any(p.requires_grad for p in tower), "the vision tower trains"
    assert all(p.requires_grad for p in language), "the language model is frozen"


def test_fsdp1_wraps_the_frozen_tower_apart(cpu_group):
    model = tiny_qwen3_vl()
    (tower,) = fsdp_utils.freeze_towers(model, transformer_impl.VISION_TOWERS)
    assert not any(p.requires_grad for p in tower.parameters())
    policy = fsdp_utils.get_fsdp_wrap_policy(module=model)
    # FSDP1 raises here where a unit mixes the frozen tower's parameters with trainable ones.
    wrapped = FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=False)
    assert {p.requires_grad for p in wrapped.parameters()} == {False, True}  # frozen units, trainable ones
