"""What ``verl-qwen3vl-plugin doctor`` reports: versions, whether verl will load the plugin, each patch's verdict on
this stack (from the same ``decide`` functions the hooks call), and the visible devices.

Whether verl loads the plugin is also observed, not only inferred: a child process imports verl with this
environment and lists the hook modules that got imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata

from verl_qwen3vl_plugin.compat import dist_version, verl_discovers_plugins
from verl_qwen3vl_plugin.hooks import HOOK_MODULES
from verl_qwen3vl_plugin.registry import DISABLE_ENV, PATCH_NAMES, POS_EMBED, Status, disabled_patches

DISTRIBUTIONS = ("verl", "transformers", "torch", "torch_npu", "vllm", "vllm_ascend", "ray", "verl-qwen3vl-plugin")
MODULES_ENV = "VERL_USE_EXTERNAL_MODULES"
PLUGINS_ENV = "VERL_USE_EXTERNAL_PLUGINS"
VERDICTS = {
    Status.APPLIED: "will apply",
    Status.FIXED_UPSTREAM: "fixed upstream",
    Status.NOT_USED: "not used by this transformers",
    Status.DISABLED: "disabled",
    Status.FAILED: "failed",
}
PROBE = (
    "import json, sys, verl, verl_qwen3vl_plugin as p; "
    "print(json.dumps({'hooks': sorted(m for m in sys.modules if m.startswith('verl_qwen3vl_plugin.hooks.')), "
    "'status': {k: [v.status.value, v.reason] for k, v in p.patch_statuses().items()}}))"
)


class UsageError(Exception):
    """Bad input from the user's environment: reported as a message and a non-zero exit, not a traceback."""


@dataclass
class Report:
    versions: dict[str, str | None]
    activation: dict[str, object]
    patches: dict[str, dict[str, str]]
    devices: dict[str, bool]
    actions: list[str] = field(default_factory=list)
    selftest: list[dict[str, object]] | None = None

    @property
    def exit_code(self) -> int:
        failed_selftest = any(not c["ok"] for c in self.selftest or [])
        return 1 if self.actions or failed_selftest else 0


def activation_line(env: dict[str, str]) -> str:
    """The exact line that activates the plugin on verl < 0.9, keeping modules the user already listed."""
    listed = [m for m in env.get(MODULES_ENV, "").split(",") if m]
    return f"export {MODULES_ENV}={','.join(listed + [m for m in HOOK_MODULES if m not in listed])}"


def check_env(env: dict[str, str]) -> None:
    """Reject environment values verl would choke on (verl splits on ',' and imports each name verbatim)."""
    modules = env.get(MODULES_ENV, "")
    if modules and any(m != m.strip() or not m for m in modules.split(",")):
        raise UsageError(f"{MODULES_ENV}={modules!r}: names must be comma-separated with no spaces or empty entries")
    raw = env.get(DISABLE_ENV, "")
    unknown = {n.strip() for n in raw.split(",") if n.strip()} - {"all", *PATCH_NAMES}
    if unknown:
        raise UsageError(
            f"{DISABLE_ENV}={raw!r}: unknown names {sorted(unknown)}; valid: all, {', '.join(PATCH_NAMES)}"
        )


def our_entry_points() -> list[str]:
    return sorted(ep.name for ep in metadata.entry_points(group="verl.plugins") if ep.value in HOOK_MODULES)


def activation(env: dict[str, str]) -> tuple[dict[str, object], list[str]]:
    """How verl will load the hooks here, what a child ``import verl`` actually loaded, and what the user must do."""
    listed = set(env.get(MODULES_ENV, "").split(","))
    by_env = [m for m in HOOK_MODULES if m in listed]
    discovers = verl_discovers_plugins()
    policy = env.get(PLUGINS_ENV, "auto").strip().lower()
    entry_points = our_entry_points()
    if discovers and policy != "auto":
        entry_points = [n for n in entry_points if policy != "none" and n in {p.strip() for p in policy.split(",")}]
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    observed = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
    info = {
        "verl_discovers_entry_points": discovers,
        "entry_points_loaded_by_verl": entry_points if discovers else [],
        MODULES_ENV: env.get(MODULES_ENV, ""),
        "import_verl_loaded_hooks": observed["hooks"] if observed else None,
        "import_verl_error": None if observed else proc.stderr.strip()[-1500:],
    }
    actions = []
    if observed is None:
        actions.append(f"`import verl` fails in this environment; fix that first:\n{info['import_verl_error']}")
    elif observed["hooks"] != list(HOOK_MODULES):
        missing = sorted(set(HOOK_MODULES) - set(observed["hooks"]))
        if discovers and policy != "auto":
            actions.append(f"{PLUGINS_ENV}={env.get(PLUGINS_ENV)!r} excludes {missing}: unset it, or run\n"
                           f"  {activation_line(env)}")  # fmt: skip
        else:
            actions.append(f"verl {dist_version('verl')} will not load {missing}; run:\n  {activation_line(env)}")
    info["active"] = observed is not None and observed["hooks"] == list(HOOK_MODULES)
    info["via"] = "entry points" if entry_points and discovers else (MODULES_ENV if by_env else None)
    return info, actions


def patch_verdicts() -> dict[str, dict[str, str]]:
    """Each patch's verdict from the same ``decide`` functions the hooks call."""
    from verl_qwen3vl_plugin.patches import npu_qwen3_vl_moe, qwen3_vl_pos_embed

    verdicts = {}
    try:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

        decisions = [qwen3_vl_pos_embed.decide(cls) for cls in (Qwen3VLVisionModel, Qwen3VLMoeVisionModel)]
        status = decisions[0][0]
        reason = "; ".join(dict.fromkeys(r for _, r in decisions))
    except Exception as exc:  # report, don't crash: the doctor runs on broken stacks too
        status, reason = Status.FAILED, f"{type(exc).__name__}: {exc}"
    verdicts[POS_EMBED] = {"verdict": VERDICTS[status], "reason": reason}
    try:
        status, reason = npu_qwen3_vl_moe.decide_installed()
    except Exception as exc:
        status, reason = Status.FAILED, f"{type(exc).__name__}: {exc}"
    verdicts[npu_qwen3_vl_moe.NAME] = {"verdict": VERDICTS[status], "reason": reason}
    return verdicts


def devices() -> dict[str, bool]:
    import torch

    npu = False
    if dist_version("torch_npu") is not None:
        try:
            import torch_npu  # noqa: F401

            npu = torch.npu.is_available()
        except Exception:
            npu = False
    return {"ascend_npu": npu, "cuda": torch.cuda.is_available()}


def build_report(env: dict[str, str] | None = None, selftest: bool = False) -> Report:
    env = dict(os.environ if env is None else env)
    check_env(env)
    versions = {name: str(v) if (v := dist_version(name)) else None for name in DISTRIBUTIONS}
    if versions["verl"] is None:
        raise UsageError("verl is not installed in this Python environment")
    info, actions = activation(env)
    patches = patch_verdicts()
    actions += [f"patch {n} failed: {p['reason']}" for n, p in patches.items() if p["verdict"] == "failed"]
    report = Report(versions, info, patches, devices(), actions)
    if disabled_patches(env):
        info["disabled_by_user"] = sorted(disabled_patches(env))
    if selftest:
        from verl_qwen3vl_plugin import selftest as tests

        report.selftest = [vars(c) for c in tests.run()]
    return report


def render(report: Report) -> str:
    lines = ["verl-qwen3vl-plugin doctor", "", "versions:"]
    lines += [f"  {name:20} {version or '-'}" for name, version in report.versions.items()]
    act = report.activation
    lines += ["", f"plugin active in verl: {'yes' if act['active'] else 'NO'} (via {act['via'] or 'nothing'})"]
    lines += [f"  verl discovers entry points: {act['verl_discovers_entry_points']}"]
    lines += [f"  {MODULES_ENV}={act[MODULES_ENV]!s}"]
    lines += [f"  hooks loaded by `import verl`: {act['import_verl_loaded_hooks']}"]
    lines += ["", "patches:"]
    lines += [f"  {name:26} {p['verdict']:30} {p['reason']}" for name, p in report.patches.items()]
    lines += ["", "devices: " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in report.devices.items())]
    if report.selftest is not None:
        lines += ["", "selftest (CPU, tiny models):"]
        lines += [f"  [{'ok' if c['ok'] else 'FAIL'}] {c['name']}: {c['detail']}" for c in report.selftest]
    if report.actions:
        lines += ["", "ACTION NEEDED:"] + [f"- {a}" for a in report.actions]
    else:
        lines += ["", "ok: the plugin is active and every patch it needs can apply"]
    return "\n".join(lines)
