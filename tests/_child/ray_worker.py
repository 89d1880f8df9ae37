"""A real local Ray worker, started with no runtime_env and no plugin variable: does it have the patches?"""

import json
import os

import ray

ray.init(num_cpus=1, include_dashboard=False)


@ray.remote
def worker():
    import verl  # noqa: F401
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

    import verl_qwen3vl_plugin as plugin
    from verl_qwen3vl_plugin import originals

    return {
        "pid": os.getpid(),
        "env": sorted(k for k in os.environ if k.startswith(("VERL_USE_EXTERNAL", "VERL_QWEN3VL_PLUGIN"))),
        "activated_by": plugin.activated_by(),
        "status": {f"{s.patch} {s.target}": s.status.value for s in plugin.patch_statuses()},
        "ours": originals.ours(Qwen3VLMoeVisionModel.forward),  # vision DP's wrapper: applied on every stack
    }


result = ray.get(worker.remote())
result["driver_pid"] = os.getpid()
ray.shutdown()
print(json.dumps(result))
