"""``overlong_prompt_filter`` in effect where verl calls it: verl 0.7.x's own ``RLHFDataset`` filtering a geo3k-shaped
image prompt with Qwen3-VL's processor, in a user's process (``filter_lengths.py``). With the plugin the filter
counts the prompt's tokenized length: kept at ``max_prompt_length`` equal to it, dropped one below, with one filter
worker or two. Control: without the patch verl counts the image as its one placeholder token."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import VERL, child_json
from verl_qwen3vl_plugin.patches.overlong_prompt_filter.spec import PATCH

HERE = Path(__file__).parent
pytestmark = pytest.mark.skipif(VERL.release[:2] != (0, 7), reason="verl 0.7.x's filter")


def kept(plugin: bool) -> tuple[dict, dict[str, int]]:
    """(the child's result, the rows kept at each ``max_prompt_length`` below the prompt's length, by how far)."""
    env = None if plugin else {"VERL_QWEN3VL_PLUGIN_DISABLE": PATCH.name}
    result = child_json(HERE / "filter_lengths.py", env=env, timeout=300)
    assert result["image_tokens"] > 1, result
    image = result["image_tokens"]
    names = {"0": "at its length", "1": "1 below", str(image - 1): "image - 1 below", str(image): "image below"}
    return result, {names.get(k, k): v for k, v in result["kept"].items()}


def test_filter_counts_the_prompts_tokenized_length():
    result, rows = kept(plugin=True)
    assert rows == {"at its length": 1, "1 below": 0, "image - 1 below": 0, "image below": 0, "1, 2 workers": 0}
    assert result["statuses"][f"{PATCH.name} {PATCH.targets[0].label}"] == "applied", result


def test_control_without_the_patch_the_image_counts_as_one_token():
    _, rows = kept(plugin=False)
    assert rows == {"at its length": 1, "1 below": 1, "image - 1 below": 1, "image below": 0, "1, 2 workers": 1}
