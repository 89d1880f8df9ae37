"""verl's ``FSDPEngine.get_per_tensor_param`` on a tiny Qwen3-VL-MoE (hidden == 2I) in a user's process, the
plugin as its start-up hook installs it: prints the keys of layer 0's experts that the engine sends."""

import json

from verl_qwen3vl_plugin.selftest.moe_blocks import engine_weight_stream
from verl_qwen3vl_plugin.selftest.tiny_models import tiny_qwen3_vl_moe

if __name__ == "__main__":
    sent = engine_weight_stream(tiny_qwen3_vl_moe(moe_intermediate_size=16))
    print(json.dumps({"keys": sorted(k for k in sent if ".layers.0.mlp.experts." in k)}))
