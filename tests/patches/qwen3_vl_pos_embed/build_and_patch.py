"""Build tiny Qwen3-VL and Qwen3-VL-MoE models (and Qwen3.5, Qwen3.5-MoE where transformers has them) through verl's
own ``apply_monkey_patch`` and run their vision towers; prints whether the plugin's interpolation is the one in
effect, and the statuses."""

import json

import torch
import verl  # noqa: F401
from verl.models.transformers.monkey_patch import apply_monkey_patch

import verl_qwen3vl_plugin as plugin
from verl_qwen3vl_plugin.patches.qwen3_vl_pos_embed.replacement import fast_pos_embed_interpolate
from verl_qwen3vl_plugin.selftest.tiny_models import (
    has_qwen3_5,
    pixel_values,
    tiny_qwen3_5,
    tiny_qwen3_vl,
    tiny_qwen3_vl_moe,
)

result = {}
grid = torch.tensor([[1, 4, 6], [2, 8, 4]])
builds = {"dense": tiny_qwen3_vl, "moe": tiny_qwen3_vl_moe}
if has_qwen3_5():
    builds.update(qwen3_5=tiny_qwen3_5, qwen3_5_moe=lambda: tiny_qwen3_5(moe=True))
for name, build in builds.items():
    model = build()
    apply_monkey_patch(model, use_remove_padding=False)
    visual = model.model.visual
    out = visual(pixel_values(grid), grid_thw=grid)
    out = out[0] if isinstance(out, tuple) else getattr(out, "last_hidden_state", out)
    result[name] = {
        "ours": type(visual).fast_pos_embed_interpolate is fast_pos_embed_interpolate,
        "finite": bool(torch.isfinite(out).all()),
    }
result["status"] = {
    s.target: [s.status.value, s.reason] for s in plugin.patch_statuses() if s.patch == "qwen3_vl_pos_embed"
}
print(json.dumps(result))
