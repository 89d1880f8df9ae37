"""Two ranks of one Ulysses group (gloo) run the plugin's split vision tower where its premise fails.

    vision_dp_premise.py checked|unchecked COLLECTIVE_TIMEOUT_S WALL_TIMEOUT_S

``checked``: the plugin as it ships. First two calls the split cannot serve (an extra keyword argument) and one it
can, at DEBUG, with the plugin's log lines kept; then ranks holding different images, with the error each raised.
``unchecked`` (the negative control): only the second part, with the group's agreement step replaced by a no-op in
this process. Prints one JSON list (per rank): ``{"logs": [[level, message], ...], "raised": <message>}``, with
``"finished": true`` in place of ``raised`` where no rank raised, or the ``{"error": ...}`` of a rank that died or
was stopped by the group's timeout or the wall-clock limit.
"""

import json
import logging
import sys

from verl_qwen3vl_plugin import originals
from verl_qwen3vl_plugin.selftest.ranks import on_two_ranks


def logs(rank):
    import torch
    import torch.distributed as dist
    from verl.utils.ulysses import set_ulysses_sequence_parallel_group

    from verl_qwen3vl_plugin.patches.qwen3_vl_vision_dp import replacement as vision_dp
    from verl_qwen3vl_plugin.patches.qwen3_vl_vision_dp.selftest import _towers
    from verl_qwen3vl_plugin.selftest.tiny_models import pixel_values

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append([record.levelname, record.getMessage()])
    logger = logging.getLogger(vision_dp.__name__)
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    cls, tower = _towers()
    forward = vision_dp.vision_dp_forward(originals.original(cls, "forward"))
    model, grid = tower(), torch.tensor([[1, 4, 6], [1, 2, 2]])
    set_ulysses_sequence_parallel_group(dist.group.WORLD)
    try:
        for _ in range(2):
            forward(model, pixel_values(grid), grid, unexpected=None)
        forward(model, pixel_values(grid), grid)
    finally:
        set_ulysses_sequence_parallel_group(None)
    return records


def run_rank(rank, mode):
    from verl_qwen3vl_plugin.patches.qwen3_vl_vision_dp import replacement as vision_dp
    from verl_qwen3vl_plugin.patches.qwen3_vl_vision_dp.selftest import mismatch

    result = {}
    if mode == "checked":
        result["logs"] = logs(rank)
    else:
        vision_dp.agree_on_inputs = lambda *args: None
    message = mismatch(rank)
    return {**result, **({"finished": True} if message == "no error" else {"raised": message})}


if __name__ == "__main__":
    mode, collective, wall = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    print(json.dumps(on_two_ranks(run_rank, mode, timeout=wall, collective_timeout=collective)))
