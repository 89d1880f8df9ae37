"""``verl-qwen3vl-plugin doctor`` in subprocesses with controlled environments, on this stack's real verl."""

from __future__ import annotations

import json

import pytest

from tests.conftest import ACTIVATE, DISCOVERS_PLUGINS, TRANSFORMERS, VERL, run_args

FIX_LINE = "export VERL_USE_EXTERNAL_MODULES=verl_qwen3vl_plugin.hooks.model_patch,verl_qwen3vl_plugin.hooks.npu_patch"
EXPECTED_VERDICTS = {
    "qwen3_vl_pos_embed": "will apply" if TRANSFORMERS.release < (5, 9) else "not used by this transformers",
    "npu_qwen3_vl_moe_routing": "will apply" if VERL.release == (0, 7, 1) else "fixed upstream",
}


def doctor(*flags: str, env: dict[str, str] | None = None):
    return run_args(["-m", "verl_qwen3vl_plugin.cli", "doctor", *flags], env)


def test_without_activation_exit_code_and_fix():
    proc = doctor()
    assert "Traceback" not in proc.stderr
    if DISCOVERS_PLUGINS:
        assert proc.returncode == 0, proc.stdout
        assert "plugin active in verl: yes (via entry points)" in proc.stdout
    else:
        assert proc.returncode == 1, proc.stdout
        assert "plugin active in verl: NO" in proc.stdout
        assert FIX_LINE in proc.stdout.splitlines()[-1]


def test_with_env_var_active_on_every_verl():
    proc = doctor(env={**ACTIVATE, "VERL_USE_EXTERNAL_PLUGINS": "none"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "plugin active in verl: yes (via VERL_USE_EXTERNAL_MODULES)" in proc.stdout


@pytest.mark.skipif(not DISCOVERS_PLUGINS, reason="entry-point discovery needs verl >= 0.9")
def test_entry_points_excluded_by_policy():
    proc = doctor(env={"VERL_USE_EXTERNAL_PLUGINS": "none"})
    assert proc.returncode == 1
    assert "VERL_USE_EXTERNAL_PLUGINS='none' excludes" in proc.stdout and FIX_LINE in proc.stdout


def test_json_report_and_verdicts(activation):
    proc = doctor("--json", env=activation)
    report = json.loads(proc.stdout)
    assert proc.returncode == report["exit_code"] == 0, report["actions"]
    assert report["versions"]["verl"] == str(VERL)
    assert {n: p["verdict"] for n, p in report["patches"].items()} == EXPECTED_VERDICTS
    assert report["activation"]["active"] is True
    assert report["devices"] == {"ascend_npu": False, "cuda": False}


def test_disabled_patch_is_reported(activation):
    report = json.loads(doctor("--json", env={**activation, "VERL_QWEN3VL_PLUGIN_DISABLE": "all"}).stdout)
    assert {p["verdict"] for p in report["patches"].values()} == {"disabled"}


def test_selftest_passes(activation):
    proc = doctor("--selftest", "--json", env=activation)
    report = json.loads(proc.stdout)
    assert report["selftest"], report
    assert all(c["ok"] for c in report["selftest"]), report["selftest"]
    assert proc.returncode == 0


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        (["--bogus"], {}, "unrecognized arguments: --bogus"),
        ([], {"VERL_QWEN3VL_PLUGIN_DISABLE": "pos_embed"}, "unknown names ['pos_embed']"),
        ([], {"VERL_USE_EXTERNAL_MODULES": "verl_qwen3vl_plugin.hooks.model_patch, x"}, "no spaces"),
    ],
)
def test_bad_input_clear_message_no_traceback(flags, env, message):
    proc = doctor(*flags, env=env)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
