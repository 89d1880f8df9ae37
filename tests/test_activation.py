"""How the plugin becomes active: verl's entry-point discovery (>= 0.9) or VERL_USE_EXTERNAL_MODULES (every verl),
in fresh processes and in a real local Ray worker; and that a broken plugin never breaks ``import verl``."""

from __future__ import annotations

import pytest

from tests.conftest import ACTIVATE, DISCOVERS_PLUGINS, run_json, run_python

IMPORT_VERL = """
import json, sys, verl
import verl_qwen3vl_plugin as plugin
hooks = sorted(m for m in sys.modules if m.startswith("verl_qwen3vl_plugin.hooks."))
print(json.dumps({"hooks": hooks, "status": {k: v.status.value for k, v in plugin.patch_statuses().items()}}))
"""
LOADED = ["verl_qwen3vl_plugin.hooks.model_patch", "verl_qwen3vl_plugin.hooks.npu_patch"]
PENDING = {"qwen3_vl_pos_embed": "pending", "npu_qwen3_vl_moe_routing": "pending"}


def test_import_verl_without_env_var_loads_plugin_only_with_discovery():
    result = run_json(IMPORT_VERL)
    assert result["hooks"] == (LOADED if DISCOVERS_PLUGINS else [])


def test_env_var_activates_on_every_verl():
    result = run_json(IMPORT_VERL, {**ACTIVATE, "VERL_USE_EXTERNAL_PLUGINS": "none"})
    assert result == {"hooks": LOADED, "status": PENDING}


@pytest.mark.skipif(not DISCOVERS_PLUGINS, reason="entry-point discovery needs verl >= 0.9")
def test_entry_points_can_be_selected_by_name():
    result = run_json(IMPORT_VERL, {"VERL_USE_EXTERNAL_PLUGINS": "qwen3vl_npu_patch"})
    assert result["hooks"] == ["verl_qwen3vl_plugin.hooks.npu_patch"]


def test_loading_twice_patches_once():
    """Entry point and env var together (and a stray second install) register each hook once."""
    proc = run_python(
        """
        import logging, verl
        logging.getLogger("verl_qwen3vl_plugin").setLevel(logging.INFO)
        from verl_qwen3vl_plugin.patches import qwen3_vl_pos_embed
        qwen3_vl_pos_embed.install()
        import wrapt
        from verl.models.transformers import monkey_patch
        from transformers.models.qwen3_vl import modeling_qwen3_vl
        inner = monkey_patch.apply_monkey_patch.__wrapped__
        assert not isinstance(inner, wrapt.FunctionWrapper), "apply_monkey_patch wrapped twice"
        """,
        ACTIVATE,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("verl-qwen3vl-plugin: qwen3_vl_pos_embed ") == 1, proc.stderr


def test_broken_plugin_never_breaks_import_verl():
    """A hook that cannot load (here: wrapt missing) leaves verl importable, warns, and records the failure."""
    proc = run_python(
        """
        import sys
        sys.modules["wrapt"] = None  # import wrapt -> ImportError
        import verl, verl_qwen3vl_plugin as plugin
        for name, status in plugin.patch_statuses().items():
            print(name, status.status.value, status.reason)
        """,
        ACTIVATE,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "qwen3_vl_pos_embed failed ModuleNotFoundError: import of wrapt halted" in proc.stdout
    assert "npu_qwen3_vl_moe_routing failed ModuleNotFoundError: import of wrapt halted" in proc.stdout
    # verl leaves logging at WARNING: these lines reaching stderr shows the failures are logged at WARNING.
    assert "verl-qwen3vl-plugin: qwen3_vl_pos_embed failed (ModuleNotFoundError" in proc.stderr
    assert "verl-qwen3vl-plugin: npu_qwen3_vl_moe_routing failed (ModuleNotFoundError" in proc.stderr


def test_unknown_disable_name_warns_with_valid_names():
    proc = run_python("import verl", {**ACTIVATE, "VERL_QWEN3VL_PLUGIN_DISABLE": "pos_embed"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "unknown patches ['pos_embed']; valid names: all, qwen3_vl_pos_embed, npu_qwen3_vl_moe_routing" in (
        proc.stderr
    )


RAY_WORKER = """
import json, os, ray

os.environ.pop("VERL_USE_EXTERNAL_MODULES", None)  # only the runtime_env may carry the activation to the worker
ray.init(num_cpus=1, include_dashboard=False, runtime_env={"env_vars": json.loads(os.environ["RUNTIME_ENV_VARS"])})


@ray.remote
def worker():
    import torch, verl
    import verl_qwen3vl_plugin as plugin
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel
    from verl_qwen3vl_plugin.compat import method_calls
    from verl_qwen3vl_plugin.models.qwen3_vl import fast_pos_embed_interpolate

    return {
        "pid": os.getpid(),
        "status": {k: v.status.value for k, v in plugin.patch_statuses().items()},
        "ours": Qwen3VLMoeVisionModel.fast_pos_embed_interpolate is fast_pos_embed_interpolate,
        "used": method_calls(Qwen3VLMoeVisionModel, "forward", "fast_pos_embed_interpolate"),
    }


result = ray.get(worker.remote())
result["driver_pid"] = os.getpid()
ray.shutdown()
print(json.dumps(result))
"""


def test_patches_active_in_a_ray_worker(activation):
    import json

    result = run_json(RAY_WORKER, {"RUNTIME_ENV_VARS": json.dumps(activation)})
    assert result["pid"] != result["driver_pid"]
    assert result["status"]["npu_qwen3_vl_moe_routing"] == "pending"
    if result["used"]:
        assert result["status"]["qwen3_vl_pos_embed"] == "applied" and result["ours"]
    else:
        assert result["status"]["qwen3_vl_pos_embed"] == "skipped: not used by this transformers"
