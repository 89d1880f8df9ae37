"""Self-test of ``fused_kernels_sp_labels``: on two gloo ranks forming verl's Ulysses group, the labels a fused
forward scores each rank's shard against, from verl 0.7's own roll (a forward that returns the labels it would score,
rolled by one as verl's does) and from the plugin's wrapper around it. Each must be the actor's own rolled labels
for that shard (``input_ids_rmpad_rolled``): the plugin's are, verl 0.7's are the first shard's on both ranks. The
whole actor with fused kernels is in the tests."""

from __future__ import annotations

import torch

from verl_qwen3vl_plugin.selftest import Check

NAME = "fused-kernel labels of each Ulysses shard"
TOKENS = 24  # a padded sequence of two 12-token shards


def _scored_labels(self, input_ids=None, labels=None, **kwargs) -> torch.Tensor:
    """What verl 0.7's fused forwards score the hidden states of this rank's shard against."""
    rolled = torch.roll(labels if labels is not None else input_ids, shifts=-1, dims=-1)
    return rolled[..., : TOKENS // 2]


def _labels_on_rank(rank: int) -> dict:
    import torch.distributed as dist
    from verl.utils.ulysses import set_ulysses_sequence_parallel_group

    from verl_qwen3vl_plugin.patches.fused_kernels_sp_labels.replacement import scoring_this_shard

    set_ulysses_sequence_parallel_group(dist.group.WORLD)
    ids = torch.arange(100, 100 + TOKENS)[None]
    expected = torch.roll(ids, shifts=-1, dims=-1).chunk(2, dim=-1)[rank]
    return {
        "verl": bool(torch.equal(_scored_labels(None, input_ids=ids), expected)),
        "plugin": bool(torch.equal(scoring_this_shard(_scored_labels)(None, input_ids=ids), expected)),
    }


def run() -> list[Check]:
    from verl_qwen3vl_plugin.patches.fused_kernels_sp_labels.spec import PATCH
    from verl_qwen3vl_plugin.registry import Verdict, decide_installed
    from verl_qwen3vl_plugin.selftest.ranks import on_two_ranks

    decision = decide_installed(PATCH, PATCH.targets[0])
    if decision.verdict is not Verdict.APPLY:
        return [
            Check(NAME, decision.verdict is not Verdict.UNRECOGNIZED, f"{decision.verdict.value}: {decision.reason}")
        ]
    results = on_two_ranks(_labels_on_rank, timeout=120, collective_timeout=60)
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return [Check(NAME, False, errors[0].strip().splitlines()[-1])]
    right = {who: [r[who] for r in results] for who in ("plugin", "verl")}
    ok = all(right["plugin"]) and not all(right["verl"])
    return [Check(NAME, ok, f"right on ranks 0, 1: plugin {right['plugin']}, verl 0.7's own {right['verl']}")]
