"""The run's rule reward (``reward.custom_reward_function``): verl's geo3k scorer (a boxed answer, a think
format), plus a dense part a random tiny policy can earn, so GRPO's advantages are not all zero and every update
moves the weights that are then synced to vLLM: the share of the response's characters that are digits."""

from __future__ import annotations


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    from verl.utils.reward_score import geo3k

    dense = sum(ch.isdigit() for ch in solution_str) / max(len(solution_str), 1)
    return geo3k.compute_score(solution_str, ground_truth) + dense
