"""``freeze_vision_tower`` in effect: verl's real FSDP engine on two FSDP2 gloo ranks holding different images
(``freeze_engine.py``, beside this file) with the setting on, off, on with LoRA, and on with the patch disabled (the
bug); FSDP1's units under the plugin's wrap policy; the WARNINGs where the setting is not honoured."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import QWEN3_5_TRAINED, VERL, child_json
from verl_qwen3vl_plugin.patches.freeze_vision_tower import replacement, spec

HERE = Path(__file__).parent  # this patch's child scripts
# CI time: every family, and LoRA, on the newest stack (the engine code is the same on verl 0.8 and 0.9); the dense
# model on the others. (transformers 4.57's Qwen3-VL-MoE block cannot train in fp32 on the CPU anyway: its scatter
# mixes dtypes, plugin or not.)
EVERY_CASE = VERL.release == (0, 9, 1)
ONE_STACK = pytest.mark.skipif(not EVERY_CASE, reason="CI time: on the newest stack (verl 0.9.1)")
KINDS = [
    "dense",
    pytest.param("moe", marks=ONE_STACK),
    *(
        pytest.param(kind, marks=[ONE_STACK, pytest.mark.skipif(not QWEN3_5_TRAINED, reason="no Qwen3.5 here")])
        for kind in ("qwen3_5", "qwen3_5_moe")
    ),
]


def engine_run(*args: str, env: dict[str, str] | None = None) -> list[dict]:
    results = child_json(HERE / "freeze_engine.py", *args, env=env, timeout=600)
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    return results


@pytest.mark.parametrize("kind", KINDS)
def test_frozen_tower_is_bitwise_unchanged_and_the_language_model_trains(kind):
    for r in engine_run(kind, "on", "fsdp2"):
        assert r["vision_params"] > 0 and r["vision_trainable"] == 0, r
        assert r["vision_change"] == 0.0 and r["vision_optimizer_states"] == 0, r
        assert r["text_change"] > 1e-3, r
        assert r["tower_output_in_graph"] == [False, False], r
        assert r["statuses"][spec.FSDP_ENGINE] == "applied", r


@ONE_STACK
def test_with_lora_the_towers_adapters_freeze_too():
    kind = "moe"
    for r in engine_run(kind, "on", "fsdp2", "lora"):
        assert r["vision_change"] == 0.0 and r["vision_optimizer_states"] == 0 and r["vision_trainable"] == 0, r
        assert r["text_change"] > 1e-3, r  # the language model's adapters


@pytest.mark.skipif(VERL.release not in ((0, 7, 1), (0, 9, 1)), reason="CI time: verl 0.7's actor and 0.9's engine")
@pytest.mark.parametrize("kind", ["dense", pytest.param("moe", marks=ONE_STACK)])
def test_frozen_tower_composes_with_vision_dp_under_ulysses(kind):
    """SP = 2 on two FSDP2 ranks, with the plugin's vision DP and single vision call, equals SP = 1 with the tower
    frozen: no tower parameter gets a gradient (``frozen_tower_sp.py``)."""
    results = child_json(HERE / "frozen_tower_sp.py", kind, timeout=500)
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    for r in results:
        assert r["log_prob_diff"] == 0.0 and r["grad_rel_diff"] < 1e-5 and r["tower_grads"] == [], r


def test_setting_off_trains_the_tower():
    for r in engine_run("dense", "off", "fsdp2"):
        assert r["vision_change"] > 1e-3 and r["vision_optimizer_states"] == r["vision_params"], r
        assert r["tower_output_in_graph"] == [True, True], r


def test_negative_control_without_the_patch_the_setting_does_nothing():
    for r in engine_run("dense", "on", "fsdp2", env={"VERL_QWEN3VL_PLUGIN_DISABLE": spec.PATCH.name}):
        assert r["vision_change"] > 1e-3 and r["vision_optimizer_states"] == r["vision_params"], r
        assert r["statuses"][spec.FSDP_ENGINE] == "disabled", r


def _units(model: torch.nn.Module, policy) -> list[list[torch.nn.Parameter]]:
    """The parameters of each FSDP1 unit ``policy`` makes: each parameter in its innermost wrapped module."""
    units: list[list[torch.nn.Parameter]] = []

    def collect(module: torch.nn.Module) -> list[torch.nn.Parameter]:
        params = list(module.parameters(recurse=False))
        for child in module.children():
            if policy(module=child, recurse=False, nonwrapped_numel=1):
                units.append(collect(child))
            else:
                params += collect(child)
        return params

    units.append(collect(model))
    return [unit for unit in units if unit]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_fsdp1_units_never_mix_frozen_and_trainable_parameters(lora):
    """FSDP1 without use_orig_params refuses a flat parameter of mixed requires_grad (no GPU here to run it): verl's
    policy leaves the tower's patch embedding, position table and mergers in the root unit with the text embedding;
    the plugin's gives the frozen tower a unit of its own."""
    from verl.utils.fsdp_utils import get_fsdp_wrap_policy

    from verl_qwen3vl_plugin.selftest.ulysses import build_model

    model = build_model("dense")
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    replacement.freeze_towers(model, spec.TOWERS)

    def mixed(policy) -> int:
        return sum(len({p.requires_grad for p in unit}) > 1 for unit in _units(model, policy))

    arguments = {"module": model, "config": {}, "is_lora": lora}
    # verl's LoRA policy gives every trainable leaf a unit of its own: uniform units already.
    assert (mixed(get_fsdp_wrap_policy(**arguments)) > 0) is not lora
    assert mixed(replacement.tower_unit(get_fsdp_wrap_policy)(**arguments)) == 0


def test_other_strategies_warn(caplog):
    post_init = replacement.carry_request(lambda config: None)
    with caplog.at_level(logging.WARNING, logger="verl_qwen3vl_plugin"):
        post_init(SimpleNamespace(strategy="megatron", freeze_vision_tower=True))
        post_init(SimpleNamespace(strategy="fsdp2", freeze_vision_tower=False))
    assert ["'megatron'" in r.getMessage() and "trains" in r.getMessage() for r in caplog.records] == [True]


def test_model_without_a_known_tower_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="verl_qwen3vl_plugin"):
        assert replacement.freeze_towers(torch.nn.Linear(2, 2), spec.TOWERS) == []
    assert len(caplog.records) == 1 and "Linear holds no" in caplog.records[0].getMessage()


def test_selftest_passes():
    from verl_qwen3vl_plugin.patches.freeze_vision_tower import selftest

    checks = selftest.run()
    assert checks and all(c.ok for c in checks), checks
