"""verl plugin that makes Qwen3-VL and Qwen3-VL-MoE train correctly on GPUs and Ascend NPUs.

verl loads ``verl_qwen3vl_plugin.hooks`` (entry points on verl >= 0.9; the start-up hook or
``VERL_USE_EXTERNAL_MODULES`` before); each hook watches its group's targets (``patches/targets.py``, generated
from the specs). This top level stays standard-library only: it is imported at ``import verl``.
"""

from verl_qwen3vl_plugin.activation import activated_by
from verl_qwen3vl_plugin.registry import PatchStatus, Status, Verdict, patch_statuses

__version__ = "0.2.0"
__all__ = ["PatchStatus", "Status", "Verdict", "activated_by", "patch_statuses", "__version__"]
