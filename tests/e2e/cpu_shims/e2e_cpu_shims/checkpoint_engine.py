"""A CPU checkpoint engine for verl's fully async trainer, for the end-to-end run only (named in
``actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module``, which verl imports on the driver, in the
trainer's workers and in the rollout's checkpoint-engine workers).

verl's fully async trainer moves weights from its trainer devices to separate rollout devices through a registered
checkpoint engine; verl 0.9.1 ships nccl (cupy), hccl (torch_npu), nixl, mooncake and kimi (RDMA), none of which runs
on a CPU. This one keeps the NCCL engine's shape and replaces its transport:

- actor rank 0 is the source; the other actor ranks sit the sync out (they still walk the weight generator, which
  gathers each full tensor collectively over the actor group); every rollout worker receives;
- the group is a ``ProcessGroupGloo`` over a ``TCPStore`` that actor rank 0 serves, built apart from torch's default
  group (the trainer's workers already have one for FSDP, and the rollout's for vLLM), once per sync;
- weights go in buckets of ``bucket_size`` bytes; each bucket is one broadcast of its length and pickled metadata,
  then one of its bytes. A receiver gets a fresh buffer per bucket, so a tensor it has yielded stays valid while the
  server adapter still holds it.

Each side also records what it moved (``weights_probe.sums``), so the run can check the rollout's weights after
each sync against the trainer's.
"""

from __future__ import annotations

import datetime
import os
import pickle
from dataclasses import dataclass

import ray
import torch
import torch.distributed as dist
from verl.checkpoint_engine.base import (
    CheckpointEngine,
    CheckpointEngineRegistry,
    merge_weight_chunks,
    split_weight_chunks,
)
from verl.utils.net_utils import get_free_port
from verl.workers.rollout.utils import ensure_async_iterator

BACKEND = "cpu_gloo"
TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("E2E_CHECKPOINT_ENGINE_TIMEOUT", "300")))


@dataclass
class Source:
    """Where the rollout workers find actor rank 0's store."""

    host: str
    port: int


@CheckpointEngineRegistry.register(BACKEND)
class GlooCheckpointEngine(CheckpointEngine):
    def __init__(self, bucket_size: int, is_master: bool = False, rollout_dtype: str = "bfloat16") -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.rollout_dtype = getattr(torch, rollout_dtype)
        self.rank = self.group = self.store = None

    def prepare(self) -> Source | None:
        if not self.is_master:
            return None
        host = ray.util.get_node_ip_address().strip("[]")
        return Source(host=host, port=get_free_port(host)[0])

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list):
        source = metadata[0]
        if not isinstance(source, Source):
            raise ValueError(f"{BACKEND}: actor rank 0 must be the checkpoint engine master, it reported {source!r}")
        world_size = 1 + rollout_world_size
        actor = {"rank": [0] + [-1] * (actor_wg_world_size - 1), "world_size": [world_size] * actor_wg_world_size,
                 "source": [source] * actor_wg_world_size}  # fmt: skip
        rollout = {"rank": list(range(1, world_size)), "world_size": [world_size] * rollout_world_size,
                   "source": [source] * rollout_world_size}  # fmt: skip
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, source: Source) -> None:
        self.rank = rank
        if rank < 0:
            return
        self.store = dist.TCPStore(source.host, source.port, world_size, is_master=rank == 0, timeout=TIMEOUT)
        self.group = dist.ProcessGroupGloo(self.store, rank, world_size, TIMEOUT)

    def finalize(self) -> None:
        self.group = self.store = None

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()

    def _send_bucket(self, bucket: torch.Tensor, metadata: dict) -> None:
        header = torch.frombuffer(bytearray(pickle.dumps(metadata)), dtype=torch.uint8)
        self._broadcast(torch.tensor([header.numel(), metadata["length"]], dtype=torch.int64))
        self._broadcast(header)
        self._broadcast(bucket[: metadata["length"]])

    def _receive_bucket(self) -> tuple[dict, torch.Tensor]:
        lengths = torch.empty(2, dtype=torch.int64)
        self._broadcast(lengths)
        header = torch.empty(int(lengths[0]), dtype=torch.uint8)
        self._broadcast(header)
        bucket = torch.empty(int(lengths[1]), dtype=torch.uint8)
        self._broadcast(bucket)
        return pickle.loads(header.numpy().tobytes()), bucket

    @torch.no_grad()
    async def send_weights(self, weights, global_steps: int | None = None):
        from e2e_cpu_shims import weights_probe

        if self.rank is None or self.rank > 0:
            raise RuntimeError(f"{BACKEND}: send_weights on rank {self.rank}; init_process_group first")
        if self.rank < 0:
            async for _ in ensure_async_iterator(weights):
                pass
            return
        sums = weights_probe.Sums()
        bucket = torch.empty(self.bucket_size, dtype=torch.uint8)
        metas, offset = {}, 0
        async for meta, chunk in split_weight_chunks(_observed(weights, sums, self.rollout_dtype), self.bucket_size):
            if offset + meta.chunk_size > self.bucket_size:
                self._send_bucket(bucket, {"bucket_meta": metas, "is_last": False, "length": offset})
                metas, offset = {}, 0
            meta.offset = offset
            metas[meta.name] = meta
            bucket[offset : offset + meta.chunk_size] = chunk
            offset += meta.chunk_size
        self._send_bucket(bucket, {"bucket_meta": metas, "is_last": True, "length": offset})
        weights_probe.write("trainer", sums, global_steps)

    @torch.no_grad()
    async def receive_weights(self, global_steps: int | None = None):
        async for name, weight in merge_weight_chunks(self._chunks(), self.bucket_size):
            yield name, weight

    async def _chunks(self):
        if self.rank is None or self.rank < 1:
            raise RuntimeError(f"{BACKEND}: receive_weights on rank {self.rank}; init_process_group first")
        while True:
            metadata, bucket = self._receive_bucket()
            for meta in metadata["bucket_meta"].values():
                yield meta, bucket[meta.offset : meta.offset + meta.chunk_size]
            if metadata["is_last"]:
                return


async def _observed(weights, sums, dtype: torch.dtype):
    """The weights as sent, each also added to ``sums`` in the dtype the rollout holds it in."""
    async for name, weight in ensure_async_iterator(weights):
        sums.add(name, weight.to(dtype))
        yield name, weight
