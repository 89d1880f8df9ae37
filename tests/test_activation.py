"""How the plugin becomes active, in fresh processes and a real local Ray worker: the start-up hook (verl < 0.9, no
environment), verl's entry points (>= 0.9), VERL_USE_EXTERNAL_MODULES (every verl), any mix of them, the opt-outs;
and that a broken plugin never breaks ``import verl``."""

from __future__ import annotations

import pytest
from packaging.version import Version

from tests.helpers import DISCOVERS_PLUGINS, POS_EMBED_USED, VERL, child_json, last_json, run_args, run_child
from verl_qwen3vl_plugin.patches import NAMES
from verl_qwen3vl_plugin.registry import ACTIVATION_LINE, HOOK_MODULES

HOOKS = sorted(HOOK_MODULES.values())
ENV_LINE = dict([ACTIVATION_LINE.removeprefix("export ").split("=", 1)])
NO_AUTOLOAD = {"VERL_QWEN3VL_PLUGIN_AUTOLOAD": "0"}
STARTUP_STATE = "print(json.dumps(sys.modules['verl_qwen3vl_plugin_autoload'].state))"
# What a user's plain `import verl` loads the plugin through on this verl.
DEFAULT_PATH = "entry points" if DISCOVERS_PLUGINS else "start-up hook"


def test_discovery_probe_matches_the_release():
    assert DISCOVERS_PLUGINS == (VERL >= Version("0.9"))


def test_plain_import_verl_loads_the_plugin():
    result = child_json("import_verl.py")
    assert result["hooks"] == HOOKS
    assert result["activated_by"] == DEFAULT_PATH
    assert result["startup_hook"] == ("left to verl's entry points" if DISCOVERS_PLUGINS else "loaded")
    assert set(result["status"].values()) == {"pending"}, result["status"]


def test_env_var_activates_on_every_verl_without_the_other_paths():
    result = child_json("import_verl.py", env={**ENV_LINE, **NO_AUTOLOAD, "VERL_USE_EXTERNAL_PLUGINS": "none"})
    assert (result["hooks"], result["activated_by"], result["startup_hook"]) == (
        HOOKS,
        "VERL_USE_EXTERNAL_MODULES",
        "off",
    )


def test_env_var_and_start_up_hook_together():
    result = child_json("import_verl.py", env=ENV_LINE)
    assert result["hooks"] == HOOKS and result["activated_by"] == "VERL_USE_EXTERNAL_MODULES"
    if not DISCOVERS_PLUGINS:
        assert result["startup_hook"] == "hooks already loaded"


def test_autoload_opt_out():
    result = child_json("import_verl.py", env=NO_AUTOLOAD)
    assert result["startup_hook"] == "off"
    # On verl >= 0.9 the opt-out concerns the start-up hook only: verl's discovery still decides.
    assert result["hooks"] == (HOOKS if DISCOVERS_PLUGINS else [])


def test_external_plugins_none_keeps_the_plugin_out_on_discovering_verl():
    result = child_json("import_verl.py", env={"VERL_USE_EXTERNAL_PLUGINS": "none"})
    assert result["hooks"] == ([] if DISCOVERS_PLUGINS else HOOKS)


@pytest.mark.skipif(not DISCOVERS_PLUGINS, reason="entry-point discovery needs verl >= 0.9")
def test_entry_points_can_be_selected_by_name():
    result = child_json("import_verl.py", env={"VERL_USE_EXTERNAL_PLUGINS": "qwen3vl_npu_patch"})
    assert result["hooks"] == [HOOK_MODULES["npu"]]


def test_every_path_at_once_patches_once():
    proc = run_child("load_every_way.py", env={**ENV_LINE, "VERL_LOGGING_LEVEL": "INFO"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for target in ("transformers.models.qwen3_vl.modeling_qwen3_vl", "verl.models.transformers.monkey_patch"):
        assert proc.stderr.count(f"qwen3_vl_pos_embed on {target} ") == 1, proc.stderr


def test_start_up_imports_nothing_before_verl():
    """Until verl is imported the hook costs its own module, which waits for verl at the front of sys.meta_path:
    not the package, no torch, no logging."""
    modules = set(child_json("startup_modules.py"))
    assert "verl_qwen3vl_plugin_autoload" in modules
    heavy = {m for m in modules if m.split(".")[0] in {"verl_qwen3vl_plugin", "torch", "logging", "verl"}}
    assert not heavy, heavy
    first_finder = last_json(run_args(["-c", "import json, sys; print(json.dumps(sys.meta_path[0].__name__))"]))
    assert first_finder == "verl_qwen3vl_plugin_autoload"


def test_broken_plugin_module_never_breaks_import_verl():
    """A plugin module that cannot load (here: its probes) leaves verl and the target importable, warns, and records
    the failure on every target imported; the others wait."""
    proc = run_child("broken_dependency.py", env=ENV_LINE)  # the start-up hook needs the probes too
    assert proc.returncode == 0, proc.stderr[-3000:]
    vision = "transformers.models.qwen3_vl.modeling_qwen3_vl"
    statuses = {(p, t): s for p, t, s, _ in last_json(proc)}
    assert {(p, t) for (p, t), s in statuses.items() if s == "failed"} == {
        ("qwen3_vl_pos_embed", vision),
        ("qwen3_vl_vision_dp", vision),
    }
    assert statuses["npu_qwen3_vl_moe_routing", "verl.models.transformers.npu_patch"] == "pending"
    # verl leaves logging at WARNING: the lines reaching stderr show the failures are logged at WARNING.
    assert f"verl-qwen3vl-plugin: qwen3_vl_pos_embed on {vision} failed (ModuleNotFoundError" in proc.stderr


@pytest.mark.skipif(DISCOVERS_PLUGINS, reason="the start-up hook leaves verl >= 0.9 to its discovery")
def test_broken_start_up_hand_over_never_breaks_import_verl():
    proc = run_child("broken_activation.py")
    result = last_json(proc)
    assert result["verl"] == str(VERL) and result["startup_hook"].startswith("failed: ModuleNotFoundError")
    assert "verl-qwen3vl-plugin: start-up hook failed: ModuleNotFoundError" in proc.stderr


@pytest.mark.skipif(DISCOVERS_PLUGINS, reason="the start-up hook leaves verl >= 0.9 to its discovery")
def test_broken_watcher_at_the_lookup_of_verl_never_breaks_import_verl():
    """The start-up hook loads the package's import watcher only when verl is looked up; if that fails, verl imports
    as if the plugin were not installed, with a WARNING."""
    code = "import json, sys; sys.modules['verl_qwen3vl_plugin.import_watch'] = None; import verl; " + STARTUP_STATE
    proc = run_args(["-c", code])
    assert last_json(proc).startswith("failed: ModuleNotFoundError")
    assert "verl-qwen3vl-plugin: start-up hook failed: ModuleNotFoundError" in proc.stderr


def test_looking_verl_up_before_importing_it_still_activates():
    """The hook's finder leaves after the first lookup of verl, which need not import it (a library checking whether
    verl is installed): the import watcher it handed over to waits for the import."""
    code = "import importlib.util, json, sys; importlib.util.find_spec('verl'); import verl; " + STARTUP_STATE
    assert last_json(run_args(["-c", code])) == ("left to verl's entry points" if DISCOVERS_PLUGINS else "loaded")


def test_unknown_disable_name_warns_with_valid_names():
    proc = run_args(["-c", "import verl"], {"VERL_QWEN3VL_PLUGIN_DISABLE": "pos_embed"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = f"unknown patches ['pos_embed']; valid names: all, {', '.join(NAMES)}"
    assert expected in proc.stderr


def test_patches_active_in_a_ray_worker_with_no_env_and_no_runtime_env():
    result = child_json("ray_worker.py")
    assert result["pid"] != result["driver_pid"] and result["env"] == []
    assert result["activated_by"] == DEFAULT_PATH
    status = result["status"]
    assert status["npu_qwen3_vl_moe_routing verl.models.transformers.npu_patch"] == "pending"
    moe = status["qwen3_vl_pos_embed transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe"]
    assert moe == ("applied" if POS_EMBED_USED else "skipped")
    assert status["qwen3_vl_vision_dp transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe"] == "applied"
    assert result["ours"], "the worker's Qwen3-VL-MoE vision forward is not the plugin's wrapper"
