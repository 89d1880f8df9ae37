"""Checks of the ``dp_actor_dynamic_batch_sync`` patch: verl's own ``prepare_dynamic_batch`` on two CPU ranks (gloo)
whose batches differ in length, as the legacy actor calls it (no ``dp_group``), with and without the plugin's name.

With the plugin both ranks make as many micro-batches as the rank that needs the most; verl 0.7.1's own call lets
them differ (what hangs FSDP). Where the patch does not apply (verl >= 0.8 has no legacy actor), nothing runs.
"""

from __future__ import annotations

from verl_qwen3vl_plugin.selftest import Check

SAMPLES = ([[(1, 8, 8)]] * 4, [[(1, 2, 2)]] * 4)  # per rank: four samples with one large / small image each
MAX_TOKENS = 64  # per micro-batch: rank 0's 4 x ~30 tokens need 2, rank 1's 4 x ~14 need 1


def batch_of(rank: int):
    """Rank ``rank``'s batch as verl's actor receives it (a ``DataProto`` with its images)."""
    from tensordict import TensorDict
    from verl import DataProto

    from verl_qwen3vl_plugin.selftest.ulysses import micro_batch

    batch = micro_batch(SAMPLES[rank])
    tensors = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")}
    return DataProto(
        batch=TensorDict(tensors, batch_size=[len(batch["input_ids"])]),
        non_tensor_batch={"multi_modal_inputs": batch["multi_modal_inputs"]},
    )


def _counts(rank: int) -> dict:
    from verl.utils.seqlen_balancing import prepare_dynamic_batch

    from verl_qwen3vl_plugin.patches.dp_actor_dynamic_batch_sync.replacement import with_default_group

    data = batch_of(rank)
    return {
        name: len(prepare(data, max_token_len=MAX_TOKENS)[0])
        for name, prepare in (("verl", prepare_dynamic_batch), ("plugin", with_default_group(prepare_dynamic_batch)))
    }


def run() -> list[Check]:
    from verl_qwen3vl_plugin.patches.dp_actor_dynamic_batch_sync.spec import PATCH
    from verl_qwen3vl_plugin.registry import Verdict, decide_installed
    from verl_qwen3vl_plugin.selftest.ranks import on_two_ranks

    target = PATCH.targets[0]
    decision = decide_installed(PATCH, target)
    verdict, reason = decision.verdict, decision.reason
    if verdict is not Verdict.APPLY:
        return [
            Check("dynamic batch counts on 2 ranks", verdict is not Verdict.UNRECOGNIZED, f"{verdict.value}: {reason}")
        ]
    results = on_two_ranks(_counts, timeout=300)
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return [Check("dynamic batch counts on 2 ranks", False, errors[0].strip().splitlines()[-1])]
    verl, plugin = ([r[name] for r in results] for name in ("verl", "plugin"))
    ok = len(set(plugin)) == 1 and plugin[0] == max(verl)
    return [Check("dynamic batch counts on 2 ranks", ok, f"micro-batches per rank: verl {verl}, plugin {plugin}")]
