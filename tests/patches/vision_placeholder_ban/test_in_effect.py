"""A sampled vision placeholder: banned in verl 0.7 / 0.8's vLLM rollout (the plugin's code, on a stand-in for
vLLM's model, which cannot run here), and refused by name through verl's own ``compute_log_prob`` and agent loop
(``placeholder_response.py``, beside this file), on every stack."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import child_json
from verl_qwen3vl_plugin.patches.vision_placeholder_ban import selftest as vision_placeholder_ban

HERE = Path(__file__).parent  # this patch's child scripts

REFUSED = "placeholder token"


def test_selftest_checks_pass():
    failed = [check for check in vision_placeholder_ban.run() if not check.ok]
    assert not failed, failed


@pytest.fixture(scope="module")
def patched():
    return child_json(HERE / "placeholder_response.py")


@pytest.fixture(scope="module")
def unpatched():
    return child_json(
        HERE / "placeholder_response.py",
        env={"VERL_QWEN3VL_PLUGIN_DISABLE": "vision_placeholder_ban,qwen3_vl_single_vision_call"},
    )


@pytest.mark.parametrize("kind", ["image", "video"])
def test_a_response_holding_a_placeholder_is_refused_by_name_in_the_trainer(patched, unpatched, kind):
    """verl's compute_log_prob: upstream's token-count error, then the sample, the token and the fix."""
    assert patched["clean"] is None
    error = patched[kind]
    assert error is not None and f"{kind} tokens do not match" in error, error
    assert "row 0 holds the" in error and f"{kind} placeholder token" in error and "Fix:" in error, error
    assert unpatched[kind] is not None and REFUSED not in unpatched[kind]


@pytest.mark.parametrize("kind", ["image", "video"])
def test_the_agent_loop_refuses_it_before_get_rope_index(patched, unpatched, kind):
    """Each sample's first pairing: transformers >= 5 raises StopIteration / TypeError there; 4.57 lets it through
    to the trainer."""
    error = patched[f"agent_loop_{kind}"]
    assert error is not None and f"holds the {kind} placeholder token" in error and "the text up to it" in error
    assert unpatched[f"agent_loop_{kind}"] is None or REFUSED not in unpatched[f"agent_loop_{kind}"]
