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
    """Every global of verl's and transformers' imported modules, and every attribute of the classes they define."""
    found = {}
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] not in ("verl", "transformers") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            found[f"{name}.{attr}"] = id(value)
            if isinstance(value, type) and value.__module__ == name:
                found.update({f"{name}.{attr}.{a}": id(v) for a, v in list(vars(value).items())})
    return found


before = snapshot()
imported = []
for info in pkgutil.walk_packages(verl_qwen3vl_plugin.__path__, f"{verl_qwen3vl_plugin.__name__}."):
    importlib.import_module(info.name)
    imported.append(info.name)
after = snapshot()
changed = sorted(k for k in before if k in after and after[k] != before[k])
print(json.dumps({"imported": imported, "changed": changed}))
