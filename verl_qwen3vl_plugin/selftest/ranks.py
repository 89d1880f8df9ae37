"""Two CPU processes in one gloo process group: for the checks and benchmarks that need a real group (FSDP2,
verl's Ulysses path), on a machine without accelerators.

Bounded in time at two levels, so a check of a hang can never stall its caller: the group's own timeout (a
collective a peer never joins raises after ``collective_timeout`` seconds) and a wall-clock limit on the whole run,
after which the ranks still running are killed.
"""

from __future__ import annotations

import os
import queue as queues
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

TIMED_OUT, DIED = "timed out", "died"


def _run(rank: int, rendezvous: str, target: Callable, args: tuple, queue, collective_timeout: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{rendezvous}",
            rank=rank,
            world_size=2,
            timeout=timedelta(seconds=collective_timeout),
        )
    except Exception:  # reported like any other failure, not as a rank that died without a word
        queue.put((rank, {"error": traceback.format_exc()[-3000:]}))
        return
    try:
        queue.put((rank, target(rank, *args)))
    except Exception:
        queue.put((rank, {"error": traceback.format_exc()[-3000:]}))
    finally:
        dist.destroy_process_group()


def on_two_ranks(target: Callable, *args, timeout: float = 600, collective_timeout: float = 300) -> list:
    """What ``target(rank, *args)`` returns on ranks 0 and 1 of a fresh gloo group, in rank order.

    ``target`` must be importable by name (the processes are spawned). A rank that raises returns
    ``{"error": <traceback>}`` instead, a rank that dies without a word ``{"error": "died with exit code N"}``, and a
    rank still running after ``timeout`` seconds is killed and returns ``{"error": "timed out"}``: one broken rank
    never hangs the caller. The ranks meet through a file of their own, not a TCP port: a free port found here could
    be taken by another group (another test worker) before rank 0 binds it.
    """
    import torch.multiprocessing as mp

    folder = tempfile.mkdtemp(prefix="verl_qwen3vl_ranks_")
    rendezvous = os.path.join(folder, "rendezvous")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_run, args=(rank, rendezvous, target, args, queue, collective_timeout)) for rank in range(2)
    ]
    for proc in procs:
        proc.start()
    results, deadline = {}, time.monotonic() + timeout
    try:
        while len(results) < len(procs) and time.monotonic() < deadline:
            try:
                rank, result = queue.get(timeout=1)
                results[rank] = result
            except queues.Empty:  # a rank killed by its backend (gloo aborts on a size mismatch) never reports
                for rank, proc in enumerate(procs):
                    if rank not in results and proc.exitcode is not None:
                        results[rank] = {"error": f"{DIED} with exit code {proc.exitcode}"}
    finally:
        for proc in procs:
            proc.join(timeout=30 if len(results) == len(procs) else 0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        shutil.rmtree(folder, ignore_errors=True)
    return [results.get(rank, {"error": TIMED_OUT}) for rank in range(2)]
