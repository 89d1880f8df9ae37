"""The model-patch hook in real processes: ``import verl`` loads it, transformers' import triggers it, and verl's
``apply_monkey_patch`` on a tiny Qwen3-VL / Qwen3-VL-MoE leaves the plugin's function in effect."""

from __future__ import annotations

import pytest

from tests.conftest import TRANSFORMERS, run_json

USED = TRANSFORMERS.release < (5, 9)

BUILD_AND_PATCH = """
import json, torch, verl
import verl_qwen3vl_plugin as plugin
from verl.models.transformers.monkey_patch import apply_monkey_patch
from verl_qwen3vl_plugin.models.qwen3_vl import fast_pos_embed_interpolate
from verl_qwen3vl_plugin.testing.tiny_models import pixel_values, tiny_qwen3_vl, tiny_qwen3_vl_moe

result = {}
grid = torch.tensor([[1, 4, 6], [2, 8, 4]])
for name, build in {"dense": tiny_qwen3_vl, "moe": tiny_qwen3_vl_moe}.items():
    model = build()
    apply_monkey_patch(model, use_remove_padding=False)
    visual = model.model.visual
    out = visual(pixel_values(grid), grid_thw=grid)
    out = out[0] if isinstance(out, tuple) else getattr(out, "last_hidden_state", out)
    result[name] = {
        "ours": type(visual).fast_pos_embed_interpolate is fast_pos_embed_interpolate,
        "finite": bool(torch.isfinite(out).all()),
    }
result["status"] = {k: [v.status.value, v.reason] for k, v in plugin.patch_statuses().items()}
print(json.dumps(result))
"""


def test_plugin_function_in_effect_after_verl_monkey_patch(activation):
    result = run_json(BUILD_AND_PATCH, activation)
    status, reason = result["status"]["qwen3_vl_pos_embed"]
    if USED:
        assert status == "applied", reason
        assert "Qwen3VLVisionModel" in reason and "Qwen3VLMoeVisionModel" in reason
    else:
        assert status == "skipped: not used by this transformers", reason
    for name in ("dense", "moe"):
        assert result[name]["finite"]
        if USED:  # transformers >= 5.9 never calls the method: verl's unused copy may stay on the class
            assert result[name]["ours"], name


def test_without_activation_nothing_is_patched():
    """The control for the test above: same process without the plugin keeps upstream's/verl's function."""
    result = run_json(BUILD_AND_PATCH, {"VERL_USE_EXTERNAL_PLUGINS": "none"})
    assert result["status"] == {}
    assert not result["dense"]["ours"] and not result["moe"]["ours"]


@pytest.mark.parametrize("names", ["all", "qwen3_vl_pos_embed", "qwen3_vl_pos_embed,npu_qwen3_vl_moe_routing"])
def test_disabled_by_name(activation, names):
    result = run_json(BUILD_AND_PATCH, {**activation, "VERL_QWEN3VL_PLUGIN_DISABLE": names})
    assert result["status"]["qwen3_vl_pos_embed"][0] == "disabled"
    assert not result["dense"]["ours"]
