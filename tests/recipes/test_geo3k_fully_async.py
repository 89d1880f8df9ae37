"""The geo3k fully async recipe composed against this stack's installed verl config files, through its launchers
(``--dry-run``), and its data preparation on a tiny geo3k-shaped dataset made here."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "geo3k_qwen3vl_30b_a3b_fully_async_grpo"
# verl 0.7.0's wheel has no fully async policy config at all: the recipe needs verl >= 0.7.1.
HAS_FULLY_ASYNC = (
    Path(importlib.util.find_spec("verl").origin).parent / "experimental" / "fully_async_policy"
).is_dir()
needs_fully_async = pytest.mark.skipif(not HAS_FULLY_ASYNC, reason="this verl has no fully async policy config")


def launch(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VERL_USE_EXTERNAL")}
    return subprocess.run(
        [str(RECIPE / script), *args],
        env={**clean, "PYTHON": sys.executable, "HOME": "/home/user", **env},
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",  # verl 0.7.1's own search path is relative to the cwd: the recipe must not depend on it
    )


def dry_run(script: str = "run.sh", *overrides: str, **env: str) -> dict:
    proc = launch(script, "--dry-run", *overrides, **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return yaml.safe_load(proc.stdout)


@pytest.fixture(scope="module")
def run_config() -> dict:
    return dry_run()


@needs_fully_async
def test_devices_32_trainer_32_rollout_on_ascend(run_config):
    c = run_config
    assert (c["trainer"]["nnodes"], c["trainer"]["n_gpus_per_node"], c["trainer"]["device"]) == (2, 16, "npu")
    assert (c["rollout"]["nnodes"], c["rollout"]["n_gpus_per_node"]) == (2, 16)
    assert c["actor_rollout_ref"]["actor"]["fsdp_config"]["fsdp_size"] == 32


@needs_fully_async
def test_gpu_profile_same_32_plus_32_on_8_device_nodes():
    c = dry_run(DEVICE="gpu")
    assert (c["trainer"]["nnodes"], c["trainer"]["n_gpus_per_node"], c["trainer"]["device"]) == (4, 8, "cuda")
    assert (c["rollout"]["nnodes"], c["rollout"]["n_gpus_per_node"]) == (4, 8)


@needs_fully_async
def test_model_parallelism_and_algorithm(run_config):
    arr = run_config["actor_rollout_ref"]
    assert arr["model"]["path"] == "Qwen/Qwen3-VL-30B-A3B-Instruct"
    assert arr["actor"]["strategy"] == "fsdp2"
    assert arr["actor"]["ulysses_sequence_parallel_size"] == 8
    assert (arr["rollout"]["tensor_model_parallel_size"], arr["rollout"]["expert_parallel_size"]) == (2, 2)
    assert (arr["rollout"]["name"], arr["rollout"]["mode"], arr["rollout"]["n"]) == ("vllm", "async", 16)
    assert arr["hybrid_engine"] is False
    assert run_config["algorithm"]["adv_estimator"] == "grpo"
    assert (arr["actor"]["optim"]["lr"], arr["actor"]["optim"]["lr_warmup_steps"]) == (1e-6, 10)
    assert (arr["actor"]["clip_ratio_low"], arr["actor"]["clip_ratio_high"]) == (0.2, 0.28)
    assert arr["actor"]["loss_agg_mode"] == "token-mean"
    assert arr["actor"]["use_dynamic_bsz"] is True
    # No reference model: no KL loss and no KL in the reward.
    assert arr["actor"]["use_kl_loss"] is False and run_config["algorithm"]["use_kl_in_reward"] is False


@needs_fully_async
def test_lengths_reward_logger_and_async(run_config):
    c = run_config
    assert (c["data"]["max_prompt_length"], c["data"]["max_response_length"]) == (2048, 8192)
    assert c["data"]["train_files"] == "/home/user/data/geo3k/train.parquet"
    assert c["reward"]["reward_manager"]["name"] == "dapo"
    assert c["reward"]["reward_kwargs"]["max_resp_len"] == 8192
    assert c["reward"]["reward_kwargs"]["overlong_buffer_cfg"] == {
        "enable": True, "len": 4096, "penalty_factor": 1.0, "log": False,
    }  # fmt: skip
    assert c["trainer"]["logger"] == ["console", "wandb"]
    assert c["async_training"]["staleness_threshold"] == 0.6
    assert c["async_training"]["trigger_parameter_sync_step"] == 16
    assert c["async_training"]["partial_rollout"] is True
    assert c["rollout"]["total_rollout_steps"] == 51200
    assert c["actor_rollout_ref"]["rollout"]["calculate_log_probs"] is True


@needs_fully_async
def test_no_activation_line_needed(run_config):
    """The plugin's start-up hook (verl < 0.9) or entry points (>= 0.9) activate every Ray worker by themselves."""
    env_vars = (run_config["ray_kwargs"]["ray_init"].get("runtime_env") or {}).get("env_vars", {})
    assert "VERL_USE_EXTERNAL_MODULES" not in env_vars


@needs_fully_async
def test_overrides_and_env_paths_apply():
    c = dry_run("run.sh", "trainer.logger=[console]", MODEL_PATH="/models/q", DATA_DIR="/d", CKPTS_DIR="/c")
    assert c["trainer"]["logger"] == ["console"]
    assert c["actor_rollout_ref"]["model"]["path"] == "/models/q"
    assert (c["data"]["val_files"], c["trainer"]["default_local_dir"]) == ("/d/test.parquet", "/c")


@needs_fully_async
def test_single_node_variant():
    c = dry_run("run_single_node.sh", DEVICE="gpu")
    assert (c["trainer"]["nnodes"], c["trainer"]["n_gpus_per_node"]) == (1, 4)
    assert (c["rollout"]["nnodes"], c["rollout"]["n_gpus_per_node"]) == (1, 4)
    arr = c["actor_rollout_ref"]
    assert arr["model"]["path"] == "Qwen/Qwen3-VL-4B-Instruct"
    assert arr["actor"]["fsdp_config"]["fsdp_size"] == 4
    assert arr["actor"]["ulysses_sequence_parallel_size"] == 1
    assert arr["rollout"]["tensor_model_parallel_size"] == 1
    assert c["reward"]["reward_kwargs"]["max_resp_len"] == c["data"]["max_response_length"] == 4096
    assert c["reward"]["reward_kwargs"]["overlong_buffer_cfg"]["enable"] is True


@pytest.mark.skipif(HAS_FULLY_ASYNC, reason="this verl has the fully async policy config")
def test_clear_error_where_verl_lacks_the_fully_async_config():
    proc = launch("run.sh", "--dry-run")
    assert proc.returncode == 1 and "the recipe needs verl >= 0.7.1" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize(
    ("env", "message"),
    [({"DEVICE": "tpu"}, "DEVICE must be npu or gpu"), ({"TRAIN_DEVICES": "20"}, "not a whole number")],
)
def test_bad_launcher_input(env, message):
    proc = launch("run.sh", "--dry-run", **env)
    assert proc.returncode == 2 and message in proc.stderr


def test_prepare_geo3k_schema_placeholders_and_reward(tmp_path):
    datasets = pytest.importorskip("datasets")
    from PIL import Image, ImageDraw

    def figure(seed: int) -> Image.Image:
        image = Image.new("RGB", (64, 48), "white")
        ImageDraw.Draw(image).polygon([(4, 40), (32, 4 + seed), (60, 40)], outline="black")
        return image

    features = datasets.Features(
        {"images": datasets.Sequence(datasets.Image()), "problem": datasets.Value("string"),
         "answer": datasets.Value("string")}
    )  # fmt: skip
    rows = {
        "images": [[figure(0)], [figure(1)], [figure(2), figure(3)]],
        "problem": ["<image>Find x.", "Find the area of the triangle.", "<image><image>Compare the angles."],
        "answer": ["3", "12.5", "\\frac{1}{2}"],
    }
    source = tmp_path / "geo3k_tiny"
    split = datasets.Dataset.from_dict(rows, features=features)
    datasets.DatasetDict({"train": split, "test": split.select([0])}).save_to_disk(str(source))

    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(RECIPE / "prepare_geo3k.py"), "--source", str(source), "--output-dir", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]

    from verl.utils.reward_score import default_compute_score

    train = datasets.Dataset.from_parquet(str(out / "train.parquet"))
    assert len(datasets.Dataset.from_parquet(str(out / "test.parquet"))) == 1
    assert set(train.column_names) == {"data_source", "prompt", "images", "ability", "reward_model", "extra_info"}
    for i, row in enumerate(train):
        assert row["data_source"] == "hiyouga/geometry3k" and row["ability"] == "math"
        (turn,) = row["prompt"]
        assert turn["role"] == "user"
        assert turn["content"].count("<image>") == len(row["images"]) == len(rows["images"][i])
        truth = row["reward_model"]["ground_truth"]
        assert truth == rows["answer"][i] and row["extra_info"]["index"] == i
        answer = f"<think>the figure shows it</think> The answer is \\boxed{{{truth}}}."
        assert default_compute_score(row["data_source"], answer, truth) == pytest.approx(1.0)
        assert default_compute_score(row["data_source"], "\\boxed{-1}", truth) == pytest.approx(0.0)


@needs_fully_async
def test_routing_replay_sets_verls_switch_where_this_verl_reads_it(mode="R3"):
    """``ROUTING_REPLAY`` sets verl's own ``router_replay.mode`` on the config the plugin reads on this verl (the
    legacy actor's on 0.7, the FSDP engine's on >= 0.8), through verl's own dataclass conversion; R3 also asks the
    rollout for its record."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay.routes import mode_of

    c = dry_run("run.sh", ROUTING_REPLAY=mode)
    actor = omega_conf_to_dataclass(OmegaConf.create(c["actor_rollout_ref"]["actor"]))
    legacy = importlib.util.find_spec("verl.workers.actor") is not None
    assert mode_of(actor if legacy else actor.fsdp_config) == mode
    assert c["actor_rollout_ref"]["rollout"]["enable_rollout_routing_replay"] is True


def test_bad_routing_replay_mode():
    proc = launch("run.sh", "--dry-run", ROUTING_REPLAY="R4")
    assert proc.returncode == 2 and "ROUTING_REPLAY must be off, R2 or R3" in proc.stderr, proc.stderr[-2000:]
