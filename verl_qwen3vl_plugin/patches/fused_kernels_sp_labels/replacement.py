"""verl 0.7.x's fused-kernel forwards of Qwen3-VL under Ulysses SP, scoring each rank's tokens against their own next
tokens.

Under SP the actor hands a vision-language model the whole (padded) sequence, and the text model slices it after the
embedding: each rank's hidden states are its shard. verl's fused forward rolls the whole ``input_ids`` by one and
then scores its ``T`` hidden states against the first ``T`` labels, the first shard's, on every rank. Here the whole
sequence is rolled first and this rank's shard of it taken, as verl's actor does for its unfused path
(``input_ids_rmpad_rolled``). verl's forward rolls the labels it is given by one before it scores them, so it gets
the shard rolled back by one: it rolls it into place.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


def this_shards_labels(tokens: torch.Tensor) -> torch.Tensor:
    """The next token of each of this rank's tokens: the whole sequence rolled by one, then this rank's shard."""
    from verl.utils.ulysses import slice_input_tensor

    return slice_input_tensor(torch.roll(tokens, shifts=-1, dims=-1), dim=-1, padding=False)


def scoring_this_shard(fused_forward: Callable) -> Callable:
    """verl 0.7.x's ``forward_with_torch_backend`` or ``forward_with_triton_backend``, given this rank's labels when
    the Ulysses group has more than one rank (with one, verl's own forward is right and runs as it is)."""

    @functools.wraps(fused_forward)
    def forward(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None, **kwargs: Any):
        from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size

        tokens = labels if labels is not None else input_ids
        if get_ulysses_sequence_parallel_world_size() > 1 and tokens is not None:
            labels = torch.roll(this_shards_labels(tokens), shifts=1, dims=-1)
        return fused_forward(self, input_ids=input_ids, labels=labels, **kwargs)

    return forward
