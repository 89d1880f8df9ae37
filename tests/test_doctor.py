"""``verl-qwen3vl-plugin doctor`` in subprocesses with controlled environments, on this stack's real verl."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess

import pytest

from tests.helpers import DISCOVERS_PLUGINS, TRANSFORMERS, VERL, run_args
from verl_qwen3vl_plugin import doctor as doctor_module
from verl_qwen3vl_plugin import environment
from verl_qwen3vl_plugin.doctor import Report, patch_verdicts, render
from verl_qwen3vl_plugin.environment import parse
from verl_qwen3vl_plugin.families import QWEN3_5, QWEN3_5_MOE, QWEN3_VL, QWEN3_VL_MOE
from verl_qwen3vl_plugin.patches import PATCHES
from verl_qwen3vl_plugin.registry import ACTIVATION_LINE, HOOK_MODULES
from verl_qwen3vl_plugin.upstream import NPU_PATCH

PATCHES_BY_NAME = [p.name for p in PATCHES]
ENV_LINE = dict([ACTIVATION_LINE.removeprefix("export ").split("=", 1)])
# What each target's declared shapes say this stack holds: the probe must read it so (test_json_report_and_verdicts).
DECLARED = {p.name: {t.label: t.shape_on(VERL.release, TRANSFORMERS.release) for t in p.targets} for p in PATCHES}
EXPECTED_VERDICTS = {
    name: {label: s.verdict.value for label, s in targets.items()} for name, targets in DECLARED.items()
}


def doctor(*flags: str, env: dict[str, str] | None = None):
    return run_args(["-m", "verl_qwen3vl_plugin.cli", "doctor", *flags], env)


@pytest.fixture(scope="module")
def plain_json() -> tuple[int, dict]:
    """One ``doctor --json`` in a user's environment (each doctor run imports verl in a child: ~10 s)."""
    proc = doctor("--json")
    return proc.returncode, json.loads(proc.stdout)


def test_plain_install_is_active_and_says_how(plain_json):
    _, report = plain_json
    how = "entry points" if DISCOVERS_PLUGINS else "start-up hook"
    text = render(Report(**{f.name: report[f.name] for f in dataclasses.fields(Report)}))
    assert f"plugin active in verl: yes (via {how})" in text


def test_start_up_hook_off_and_no_env_line_gives_the_fix():
    proc = doctor(env={"VERL_QWEN3VL_PLUGIN_AUTOLOAD": "0"})
    assert "Traceback" not in proc.stderr
    if DISCOVERS_PLUGINS:  # verl's discovery does not depend on the start-up hook
        assert proc.returncode == 0, proc.stdout
    else:
        assert proc.returncode == 1, proc.stdout
        assert "plugin active in verl: NO" in proc.stdout
        assert "the start-up hook is switched off (VERL_QWEN3VL_PLUGIN_AUTOLOAD='0')" in proc.stdout
        assert ACTIVATION_LINE in proc.stdout.splitlines()[-1]


def test_with_env_line_only_active_on_every_verl():
    proc = doctor(env={**ENV_LINE, "VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_QWEN3VL_PLUGIN_AUTOLOAD": "0"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "plugin active in verl: yes (via VERL_USE_EXTERNAL_MODULES)" in proc.stdout


@pytest.mark.skipif(not DISCOVERS_PLUGINS, reason="entry-point discovery needs verl >= 0.9")
def test_entry_points_excluded_by_policy():
    proc = doctor(env={"VERL_USE_EXTERNAL_PLUGINS": "none"})
    assert proc.returncode == 1
    assert "VERL_USE_EXTERNAL_PLUGINS='none' excludes" in proc.stdout and ACTIVATION_LINE in proc.stdout


def test_json_report_and_verdicts(plain_json):
    returncode, report = plain_json
    assert returncode == report["exit_code"] == 0, report["actions"]
    assert report["versions"]["verl"] == str(VERL)
    found = {n: {m: (t["shape"], t["verdict"]) for m, t in p["targets"].items()} for n, p in report["patches"].items()}
    declared = {n: {m: (s.id, s.verdict.value) for m, s in targets.items()} for n, targets in DECLARED.items()}
    assert found == declared
    assert report["activation"]["active"] is True
    assert report["activation"]["import_verl_loaded_hooks"] == list(HOOK_MODULES.values())
    assert report["devices"] == environment.devices()  # what this process sees, on the same machine as the doctor
    for patch in PATCHES:
        entry = report["patches"][patch.name]
        assert entry["concerns_this_machine"] is (patch.devices is None), patch.name
        applies = "apply" in EXPECTED_VERDICTS[patch.name].values()
        # No NPU here: the NPU patches that apply are applied in verl's processes but never run on this machine.
        assert (entry["dormant"] is not None) is (applies and patch.devices == ("npu",)), (patch.name, entry)


@pytest.mark.parametrize(
    ("available", "expected"), [(True, True), (False, False), (None, False)], ids=["npu", "none", "broken_torch_npu"]
)
def test_an_npu_is_seen_where_torch_npu_reports_one(monkeypatch, available, expected):
    """Off Ascend too: a stand-in ``torch_npu`` with an NPU, without one, or one that fails to import (None)."""
    import sys
    import types

    import torch

    real = environment.dist_version
    monkeypatch.setattr(environment, "dist_version", lambda name: "2.7.1" if name == "torch_npu" else real(name))
    # None in sys.modules: `import torch_npu` raises, whatever torch.npu would say.
    monkeypatch.setitem(sys.modules, "torch_npu", None if available is None else types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: available is not False), raising=False)
    environment.devices.cache_clear()
    try:
        assert environment.devices() == {"cuda": torch.cuda.is_available(), "npu": expected}
    finally:
        environment.devices.cache_clear()  # the next caller sees this machine again


@pytest.mark.parametrize("listed", ["qwen3_vl_pos_embed", "all"])
def test_the_doctors_env_reaches_every_verdict(monkeypatch, listed):
    """The environment handed to the doctor, not this process's, decides what is disabled (activation, observed in
    a child, is what the other tests check)."""
    monkeypatch.delenv("VERL_QWEN3VL_PLUGIN_DISABLE", raising=False)
    monkeypatch.setattr(doctor_module, "activation", lambda env: ({"active": True}, []))
    report = doctor_module.build_report(env={"VERL_QWEN3VL_PLUGIN_DISABLE": listed})
    assert report.activation["disabled_by_user"] == sorted(PATCHES_BY_NAME if listed == "all" else [listed])
    for name, patch in report.patches.items():
        disabled = {t["verdict"] == "disabled" for t in patch["targets"].values()}
        assert disabled == {listed in ("all", name)}, (name, patch)


@pytest.mark.parametrize("npu", [False, True], ids=["no_npu", "npu"])
def test_applied_but_not_run_here_says_why(npu):
    """On Ascend, verl's npu_patch replaces the MoE block whose experts the sparse-experts patch replaces; off Ascend,
    the NPU patches never run. Either way the doctor names the reason, and the exit code does not change."""
    report, _ = patch_verdicts({"cuda": False, "npu": npu}, frozenset())
    dormant = {name: entry["dormant"] for name, entry in report.items() if entry["dormant"]}
    expected = {n for n, v in EXPECTED_VERDICTS.items() if "apply" in v.values()}
    if npu:
        expected &= {"qwen3_vl_moe_sparse_experts"}
        assert all("npu_patch replaces Qwen3VLMoeTextSparseMoeBlock" in r for r in dormant.values()), dormant
    else:
        expected &= {p.name for p in PATCHES if p.devices == ("npu",)}
        assert all("this machine has none" in r for r in dormant.values()), dormant
    assert set(dormant) == expected


@pytest.mark.skipif(
    VERL.release not in ((0, 7, 1), (0, 9, 1)),
    reason="CI time: the self-test's checks are the suite's own check functions, run on every stack; the whole "
    "`doctor --selftest` runs on the main stack and the newest",
)
def test_says_whether_routing_replay_is_available_and_how(plain_json):
    from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay.settings import ENGINE_SWITCH, LEGACY_SWITCH

    _, report = plain_json
    line = report["routing_replay"]
    assert line.startswith("available (off by default)"), line
    assert ENGINE_SWITCH in line and (LEGACY_SWITCH in line) == (VERL.release < (0, 8)), line
    assert "enable_rollout_routing_replay=True" in line
    # the test stacks install no rollout engine; tests/test_rollout_engines.py covers those that record or not
    assert report["rollout_side"].startswith("unknown here: no vLLM"), report["rollout_side"]


def test_routing_replay_unavailable_says_why():
    from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay import spec as replay

    labels = [t.label for t in replay.PATCH.targets]
    routers = [
        t.label for t in replay.PATCH.targets if t.module in (QWEN3_VL_MOE.modeling, QWEN3_5_MOE.modeling, NPU_PATCH)
    ]
    qwen3_5_router = f"{QWEN3_5_MOE.modeling}:{replay.QWEN3_5_ROUTER}.forward"
    no_router = dict.fromkeys(labels, "apply") | dict.fromkeys(routers, "unrecognized")
    assert "no Qwen3-VL-MoE or Qwen3.5-MoE router" in replay.availability(no_router)
    assert replay.availability(no_router | {qwen3_5_router: "apply"}).startswith("available")  # Qwen3.5-MoE's alone
    no_path = dict.fromkeys(labels, "unrecognized") | {f"{QWEN3_VL_MOE.modeling}:{replay.ROUTER}.forward": "apply"}
    assert "neither verl's legacy FSDP actor nor its FSDP engine" in replay.availability(no_path)
    assert "disabled" in replay.availability(dict.fromkeys(labels, "disabled"))


def test_selftest_runs_every_patch_and_passes():
    proc = doctor("--selftest", "--json")
    report = json.loads(proc.stdout)
    names = [c["name"] for c in report["selftest"]]
    assert any(n.startswith("pos_embed") for n in names) and any(n.startswith("npu") for n in names), names
    assert all(c["ok"] for c in report["selftest"]), report["selftest"]
    assert proc.returncode == 0


def test_closing_line_counts_failed_selftest_checks(plain_json):
    """A failed self-test check never ends under an "ok" line: the closing lines count and name the failures."""
    _, report = plain_json
    fields = {f.name: report[f.name] for f in dataclasses.fields(Report)} | {"actions": []}
    passed, failed = ("a", True, "fine"), ("routing replay through verl", False, "child process failed")
    text = render(Report(**fields | {"selftest": [dict(zip(("name", "ok", "detail"), passed, strict=True))]}))
    assert text.splitlines()[-1].startswith("ok: ") and "all 1 self-test checks passed" in text
    bad = Report(
        **fields | {"selftest": [dict(zip(("name", "ok", "detail"), c, strict=True)) for c in (passed, failed)]}
    )
    text = render(bad)
    assert "\nok: " not in text and bad.exit_code == 1
    assert "SELFTEST FAILED: 1 of 2 checks" in text and text.splitlines()[-1] == "- routing replay through verl"


def test_selftest_that_cannot_import_says_what_it_needs(monkeypatch, tmp_path):
    """A self-test child whose import fails reports the package to install, not a traceback."""
    from verl_qwen3vl_plugin import selftest

    (tmp_path / "selftest_needs_probe.py").write_text("import einops_not_here.sub\n")
    monkeypatch.setitem(os.environ, "PYTHONPATH", str(tmp_path))
    (check,) = selftest.in_child("selftest_needs_probe", "needs probe")
    assert not check.ok and check.detail.startswith("needs the Python module 'einops_not_here'"), check.detail
    assert "Traceback" not in check.detail


def test_a_missing_submodule_of_an_installed_package_is_reported_as_it_is():
    from verl_qwen3vl_plugin import selftest

    assert selftest.needs("ModuleNotFoundError: No module named 'verl.no_such_module'") is None
    chained = "ModuleNotFoundError: No module named 'einops_not_here'\n\nDuring handling...\nValueError: boom"
    assert selftest.needs(chained) is None


def _unrecognized_everywhere(monkeypatch):
    unknown = parse("x = 1\n")
    monkeypatch.setattr("verl_qwen3vl_plugin.environment.source_of", lambda name: unknown)


@pytest.mark.parametrize("npu", [False, True], ids=["no_npu", "npu"])
def test_unrecognized_upstream_is_an_action_only_where_the_device_is(monkeypatch, npu):
    """Synthesized sources: every target unrecognized. The NPU patch counts only on a machine with an NPU."""
    _unrecognized_everywhere(monkeypatch)
    report, actions = patch_verdicts({"cuda": False, "npu": npu}, frozenset())
    assert {t["verdict"] for p in report.values() for t in p["targets"].values()} == {"unrecognized"}
    flagged = {a.split()[1] for a in actions}
    expected = {p.name for p in PATCHES if p.devices is None or (npu and "npu" in p.devices)}
    assert flagged == expected


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


def test_verls_model_modules_import_here(plain_json):
    """Every CI stack can train the lines its verl ships: their forward modules import, and the doctor says so."""
    code, report = plain_json
    modules = report["activation"]["model_modules"]
    expected = [QWEN3_VL.verl_forward] + ([QWEN3_5.verl_forward] if VERL.release >= QWEN3_5.verl else [])
    assert sorted(modules) == sorted(expected) and not any(modules.values()), modules
    assert code == 0


def test_a_model_module_that_cannot_import_fails_the_doctor(monkeypatch):
    """verl 0.9.1 on transformers >= 5.23: the probes read source and pass, yet verl's Qwen3-VL module fails on
    import. The child's check catches the error; the doctor names the module, the error and verl's pin, and exits 1."""
    import importlib

    from verl_qwen3vl_plugin import import_verl_probe

    error = "cannot import name 'Qwen3VLCausalLMOutputWithPast' from 'transformers.models.qwen3_vl.modeling_qwen3_vl'"
    real = importlib.import_module

    def import_module(name, *args):
        if name == QWEN3_VL.verl_forward:
            raise ImportError(error)
        return real(name, *args)

    monkeypatch.setattr(import_verl_probe.importlib, "import_module", import_module)
    observed = import_verl_probe.model_modules()
    assert observed[QWEN3_VL.verl_forward] == f"ImportError: {error}", observed
    child = {"hooks": list(HOOK_MODULES.values()), "activated_by": "entry points", "startup_hook": None}
    stdout = json.dumps(child | {"model_modules": observed})
    monkeypatch.setattr(
        doctor_module.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=stdout, stderr="")
    )
    report = doctor_module.build_report(env={})
    text = render(report)
    assert report.exit_code == 1 and "\nok: " not in text
    assert f"{QWEN3_VL.verl_forward:58} DOES NOT IMPORT: ImportError: {error}" in text
    (action,) = [a for a in report.actions if QWEN3_VL.verl_forward in a]
    assert "verl cannot train Qwen3-VL, Qwen3-VL-MoE here" in action and f"verl {VERL}" in action, action
