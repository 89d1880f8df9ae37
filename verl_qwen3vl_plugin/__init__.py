"""verl plugin that makes Qwen3-VL and Qwen3-VL-MoE train correctly on GPUs and Ascend NPUs.

The entry points (group ``verl.plugins``) name the modules in ``verl_qwen3vl_plugin.hooks``; importing one registers
its patch. This package's top level stays import-light (standard library only) because verl imports it at start-up.
"""

from verl_qwen3vl_plugin.registry import PATCH_NAMES, PatchStatus, Status, patch_statuses

__version__ = "0.1.0"
__all__ = ["PATCH_NAMES", "PatchStatus", "Status", "patch_statuses", "__version__"]
