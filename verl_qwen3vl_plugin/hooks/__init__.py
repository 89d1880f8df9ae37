"""The modules verl's plugin loading imports (entry points, or VERL_USE_EXTERNAL_MODULES on verl < 0.9).

Each is thin: importing it installs one patch's post-import hooks and never raises.
"""

# Keep in sync with [project.entry-points."verl.plugins"] in pyproject.toml.
HOOK_MODULES = ("verl_qwen3vl_plugin.hooks.model_patch", "verl_qwen3vl_plugin.hooks.npu_patch")
