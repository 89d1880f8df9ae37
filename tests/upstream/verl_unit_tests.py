"""verl's own CPU unit tests for the modules the plugin wraps, run with the plugin active and with every patch
disabled (``VERL_QWEN3VL_PLUGIN_DISABLE=all``); the outcomes must be identical, test by test.

    python tests/upstream/verl_unit_tests.py [--git VERL_GIT_DIR [--tag RELEASE]]

The tests come from verl's source distribution on PyPI for the installed verl (what CI can reach), or, with
``--git``, from a clone of verl's repository at the installed release's tag (more files: the sdists before 0.9.0 hold
none of these). Only the files of ``FILES`` that the source holds run; a test that fails either way is reported, not
an error: only a difference is.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

# The CPU test files that exercise what the plugin wraps: the FSDP engine and its workers (routing replay, nested
# position ids), the legacy actor's config (routing replay's switch), verl's padding (the record's no-padding
# layout), the agent loop (vision_placeholder_ban, position ids), the vLLM rollout's placeholder ban and routed
# experts, the models' Ulysses path (vision DP, the delta-net layers).
FILES = (
    "tests/workers/test_fsdp_gradient_accumulation_sync_on_cpu.py",
    "tests/workers/test_engine_forward_step_detach_on_cpu.py",
    "tests/workers/test_engine_return_model_output_on_cpu.py",
    "tests/workers/test_packed_pad_to_length_on_cpu.py",
    "tests/workers/test_router_replay_engine_helpers_on_cpu.py",
    "tests/workers/config/test_actor_config_on_cpu.py",
    "tests/workers/config/test_engine_config_on_cpu.py",
    "tests/workers/rollout/test_vision_placeholder_tokens_on_cpu.py",
    "tests/workers/rollout/test_llm_server_routed_experts_on_cpu.py",
    "tests/utils/test_padding_on_cpu.py",
    "tests/experimental/agent_loop/test_multimodal_position_ids_on_cpu.py",
    "tests/experimental/agent_loop/test_agent_loop_extra_fields_schema_on_cpu.py",
    "tests/trainer/ppo/v1/test_agent_loop_tq_on_cpu.py",
    "tests/trainer/ppo/test_rollout_moe_lb_metrics_on_cpu.py",
    "tests/models/test_fused_kernels_ulysses_sp_on_cpu.py",
)
OFF = {"VERL_QWEN3VL_PLUGIN_DISABLE": "all"}


def from_sdist(version: str, into: Path) -> None:
    """verl's source distribution from PyPI, its ``tests/`` extracted into ``into``."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "verl", f"verl=={version}",
         "-d", str(into)],
        check=True,
    )  # fmt: skip
    with tarfile.open(next(into.glob("verl-*.tar.gz"))) as sdist:
        for member in sdist.getmembers():
            parts = Path(member.name).parts
            if len(parts) > 1 and parts[1] == "tests":
                member.name = str(Path(*parts[1:]))
                sdist.extract(member, into, filter="data")


def from_git(git_dir: str, version: str, into: Path) -> None:
    """``tests/`` of verl's repository at tag ``v<version>``."""
    archive = subprocess.run(
        ["git", f"--git-dir={git_dir}", "archive", f"v{version}", "tests"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tests:
        tests.extractall(into, filter="data")


def outcomes(root: Path, files: list[str], env: dict[str, str], name: str) -> dict[str, str]:
    """Test id -> passed / failure / error / skipped, from one pytest run in ``root`` (outside any verl source)."""
    report = root / f"{name}.xml"
    report.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors"]
    command += [f"--junitxml={report}", *files]
    proc = subprocess.run(command, cwd=root, env=env, check=False, timeout=1800, capture_output=True, text=True)
    if not report.is_file():
        raise SystemExit(f"pytest wrote no report ({name}, exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    results = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
        results[f"{case.get('classname')}::{case.get('name')}"] = outcome
    return results


def compare(root: Path, files: list[str], env: dict[str, str]) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """(outcomes on, outcomes off, tests whose outcome differs after one rerun of their files: upstream's Ray and
    TransferQueue tests can flake)."""
    on, off = outcomes(root, files, env, "on"), outcomes(root, files, env | OFF, "off")
    differ = sorted(t for t in on.keys() | off.keys() if on.get(t) != off.get(t))
    again = sorted({f for f in files for t in differ if t.startswith(f[:-3].replace("/", ".") + ":")
                    or t.startswith(f[:-3].replace("/", ".") + ".")})  # fmt: skip
    if again:
        on.update(outcomes(root, again, env, "on-again"))
        off.update(outcomes(root, again, env | OFF, "off-again"))
        differ = sorted(t for t in on.keys() | off.keys() if on.get(t) != off.get(t))
    return on, off, differ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--git", help="a clone of verl's repository (its tags v<release>)")
    parser.add_argument("--tag", help="with --git: this release's tests instead of the installed one's")
    args = parser.parse_args(argv)
    version = args.tag or metadata.version("verl")
    with tempfile.TemporaryDirectory(prefix="verl-tests-") as tmp:
        root = Path(tmp)
        (from_git(args.git, version, root) if args.git else from_sdist(version, root))
        files = [f for f in FILES if (root / f).is_file()]
        source = f"verl's repository at v{version}" if args.git else f"verl {version}'s PyPI sdist"
        print(f"verl {metadata.version('verl')}, tests from {source}: {len(files)} of {len(FILES)} files")
        if not files:
            return 0
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VERL_QWEN3VL_PLUGIN", "VERL_USE_EXTERNAL"))}
        on, off, differ = compare(root, files, env)
    for test in sorted(on.keys() | off.keys()):
        mark = "DIFFERS" if test in differ else ""
        print(f"  {on.get(test, '-'):8} {off.get(test, '-'):8} {test} {mark}")
    counts = {o: sum(v == o for v in on.values()) for o in ("passed", "failure", "error", "skipped")}
    print(f"plugin on / off: {len(on)} tests, with the plugin {counts}; {len(differ)} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
