"""Import verl's and transformers' Qwen3-VL modules, then every module of the wheel, and print which verl or
transformers globals changed: nothing the wheel imports may rebind them (a patch's ``apply`` aside, and the patches
are disabled here)."""

import importlib
import json
import pkgutil
import sys

import transformers.models.qwen3_vl.modeling_qwen3_vl  # noqa: F401
import transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe  # noqa: F401
import verl.models.transformers.monkey_patch  # noqa: F401
import verl.models.transformers.qwen3_vl  # noqa: F401

import verl_qwen3vl_plugin


def snapshot() -> dict[str, int]:
    return {
        f"{name}.{attr}": id(value)
        for name, module in list(sys.modules.items())
        if name.split(".")[0] in ("verl", "transformers") and module is not None
        for attr, value in list(vars(module).items())
    }


before = snapshot()
imported = []
for info in pkgutil.walk_packages(verl_qwen3vl_plugin.__path__, f"{verl_qwen3vl_plugin.__name__}."):
    importlib.import_module(info.name)
    imported.append(info.name)
after = snapshot()
changed = sorted(k for k in before if k in after and after[k] != before[k])
print(json.dumps({"imported": imported, "changed": changed}))
