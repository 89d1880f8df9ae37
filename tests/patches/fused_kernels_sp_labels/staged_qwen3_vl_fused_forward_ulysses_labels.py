"""Qwen3-VL's fused-kernel forward (torch backend) under Ulysses SP scores each rank's tokens against their own next
tokens. Two gloo ranks in one SP group; a stand-in model embeds the whole sequence and keeps this rank's shard, as
Qwen3-VL's text model does under SP. Each rank's log-probs must equal those of the whole sequence scored without SP,
at that rank's positions. Before the fix every rank scored its tokens against the first shard's labels."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers.modeling_outputs import BaseModelOutputWithPast
from verl.models.transformers.qwen3_vl import forward_with_torch_backend
from verl.utils.ulysses import set_ulysses_sequence_parallel_group, slice_input_tensor

VOCAB, HIDDEN, LENGTH, WORLD = 32, 8, 12, 2


class ShardingTextModel(torch.nn.Module):
    """Qwen3-VL's text model under SP, reduced to its embedding: the whole sequence in, this rank's shard out."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)

    def forward(self, input_ids, **kwargs):
        hidden = slice_input_tensor(self.embed(input_ids), dim=1, padding=False)
        return BaseModelOutputWithPast(last_hidden_state=hidden)


class TinyQwen3VL(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = ShardingTextModel()
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)


def score_on_rank(rank: int, rendezvous: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
    try:
        set_ulysses_sequence_parallel_group(dist.group.WORLD)
        model = TinyQwen3VL()
        input_ids = torch.randint(0, VOCAB, (1, LENGTH), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            log_probs = forward_with_torch_backend(model, input_ids=input_ids).log_probs
            logits = model.lm_head(model.model.embed(input_ids)).float()
            next_tokens = torch.roll(input_ids, shifts=-1, dims=-1).unsqueeze(-1)
            expected = torch.log_softmax(logits, dim=-1).gather(-1, next_tokens).squeeze(-1)
        shard = LENGTH // WORLD
        torch.testing.assert_close(log_probs, expected[:, rank * shard : (rank + 1) * shard])
    finally:
        set_ulysses_sequence_parallel_group(None)
        dist.destroy_process_group()


def test_each_sp_rank_scores_its_own_shard(tmp_path):
    mp.spawn(score_on_rank, args=(str(tmp_path / "rendezvous"),), nprocs=WORLD, join=True)
