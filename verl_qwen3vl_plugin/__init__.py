"""verl plugin that makes Qwen3-VL and Qwen3-VL-MoE train correctly on GPUs and Ascend NPUs.

verl loads ``verl_qwen3vl_plugin.hooks`` (entry points on verl >= 0.9; the start-up hook or
``VERL_USE_EXTERNAL_MODULES`` before); each hook watches its group's targets (``patches/targets.py``, generated
from the specs). The public names load on first use: the start-up hook imports ``import_watch`` below this package
in every process that imports verl, which must cost no more than that module.
"""

__version__ = "0.2.0"
_PUBLIC = {
    "activated_by": "verl_qwen3vl_plugin.activation",
    "PatchStatus": "verl_qwen3vl_plugin.registry",
    "Status": "verl_qwen3vl_plugin.registry",
    "Verdict": "verl_qwen3vl_plugin.registry",
    "patch_statuses": "verl_qwen3vl_plugin.registry",
}
__all__ = [*sorted(_PUBLIC), "__version__"]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_PUBLIC[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
