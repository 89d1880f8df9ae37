"""verl 0.7.x's real ``DataParallelPPOActor`` on a tiny Qwen3-VL-MoE with an image (CPU stand-ins named in the
child script): with the plugin, ``compute_log_prob`` (eval) and the training forward of ``update_policy`` give the
same log-probs bit for bit, so the on-policy PPO ratio is exactly 1."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import VERL, child_json

HERE = Path(__file__).parent  # this patch's child scripts

pytestmark = pytest.mark.skipif(
    VERL.release[:2] != (0, 7), reason="the actor API and stack of verl 0.7.x (transformers 4.57), where it applies"
)
OFF = {"VERL_QWEN3VL_PLUGIN_AUTOLOAD": "0"}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_eval_and_training_log_probs_identical_with_the_plugin(dtype):
    result = child_json(HERE / "actor_log_probs.py", dtype)
    assert result["experts_forward"] == "verl_qwen3vl_plugin.patches.qwen3_vl_moe_sparse_experts.replacement"
    assert result["equal"], result


def test_without_the_plugin_bf16_log_probs_differ_the_control():
    result = child_json(HERE / "actor_log_probs.py", "bf16", env=OFF)
    assert result["experts_forward"] == "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe"
    assert not result["equal"] and result["max_abs_diff"] > 0, result
