"""With ``use_dynamic_bsz`` every data-parallel rank makes the same number of micro-batches in ``dp_actor`` and
``dp_critic``: rank 0 holds four 8-token sequences (two micro-batches of 16 tokens), rank 1 four 2-token ones (one);
both ranks must make two forward passes, the most any rank needs, or FSDP hangs on the pass only rank 0 makes. Two
gloo ranks; the forward is replaced by one that counts the micro-batches it is given. Before the fix the actor and
critic passed no ``dp_group`` and the count was not synced: rank 1 made one pass."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf
from verl import DataProto
from verl.workers.actor.dp_actor import DataParallelPPOActor
from verl.workers.critic.dp_critic import DataParallelPPOCritic

WORLD, BATCH, RESPONSE, MAX_TOKEN_LEN = 2, 4, 2, 16


def batch_on(rank: int) -> DataProto:
    """Four sequences of 8 tokens on rank 0 and of 2 on rank 1 (left-padded to 8)."""
    length = 8 if rank == 0 else 2
    attention_mask = torch.zeros(BATCH, 8, dtype=torch.int64)
    attention_mask[:, 8 - length :] = 1
    tensors = {
        "input_ids": torch.ones(BATCH, 8, dtype=torch.int64),
        "attention_mask": attention_mask,
        "position_ids": torch.cumsum(attention_mask, dim=-1),
        "responses": torch.ones(BATCH, RESPONSE, dtype=torch.int64),
    }
    meta = {"micro_batch_size": 2, "temperature": 1.0, "use_dynamic_bsz": True, "max_token_len": MAX_TOKEN_LEN}
    return DataProto.from_dict(tensors=tensors, meta_info=meta)


def counting(worker, counts: list[int], output: str):
    """Replace ``worker``'s forward with one that counts its calls and returns zeros of the expected shape."""

    def forward(model_inputs, *args, **kwargs):
        counts.append(1)
        zeros = torch.zeros(model_inputs["responses"].shape)
        return {output: zeros} if output else zeros

    worker._forward_micro_batch = forward
    return worker


def count_on_rank(rank: int, rendezvous: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
    try:
        actor_config = OmegaConf.create(
            {
                "ulysses_sequence_parallel_size": 1,
                "entropy_from_logits_with_chunking": False,
                "use_torch_compile": False,
                "fsdp_config": {"dtype": "float32"},
            }
        )
        critic_config = OmegaConf.create({"model": {}, "ulysses_sequence_parallel_size": 1})
        module = torch.nn.Linear(1, 1)
        actor_counts, critic_counts = [], []
        actor = counting(DataParallelPPOActor(actor_config, module), actor_counts, "log_probs")
        actor.compute_log_prob(batch_on(rank))
        critic = counting(DataParallelPPOCritic(critic_config, module, None), critic_counts, "")
        critic.compute_values(batch_on(rank))
        assert (len(actor_counts), len(critic_counts)) == (2, 2), (rank, len(actor_counts), len(critic_counts))
    finally:
        dist.destroy_process_group()


def test_ranks_agree_on_the_micro_batch_count(tmp_path):
    mp.spawn(count_on_rank, args=(str(tmp_path / "rendezvous"),), nprocs=WORLD, join=True)
