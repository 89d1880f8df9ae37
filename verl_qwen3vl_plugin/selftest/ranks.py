"""Two CPU processes in one gloo process group: for the checks and benchmarks that need a real group (FSDP2,
verl's Ulysses path), on a machine without accelerators."""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable


def _run(rank: int, port: int, target: Callable, args: tuple, queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        queue.put((rank, target(rank, *args)))
    except Exception:
        queue.put((rank, {"error": traceback.format_exc()[-3000:]}))
    finally:
        dist.destroy_process_group()


def on_two_ranks(target: Callable, *args, timeout: float = 600) -> list:
    """What ``target(rank, *args)`` returns on ranks 0 and 1 of a fresh gloo group, in rank order.

    ``target`` must be importable by name (the processes are spawned). A rank that raises returns
    ``{"error": <traceback>}`` instead, so one broken rank never hangs the caller.
    """
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_run, args=(rank, port, target, args, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        results = dict(queue.get(timeout=timeout) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=60)
    return [results[rank] for rank in range(2)]
