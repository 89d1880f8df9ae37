"""verl's ``prepare_dynamic_batch`` as verl 0.7.0 called it: with the default group when the caller passes none.

When it applies, and when it can be removed: the ``dp_actor_dynamic_batch_sync`` spec.
"""

from __future__ import annotations

import functools
from collections.abc import Callable


def with_default_group(prepare: Callable) -> Callable:
    @functools.wraps(prepare)
    def prepare_dynamic_batch(*args, **kwargs):
        """verl's ``prepare_dynamic_batch``, given the default group when the caller passes none, so that every rank
        makes as many micro-batches as the rank that needs the most. Every argument passes through as given."""
        import torch.distributed as dist

        if dist.is_initialized():
            if len(args) >= 3 and args[2] is None:
                args = (*args[:2], dist.group.WORLD, *args[3:])
            elif len(args) < 3 and kwargs.get("dp_group") is None:
                kwargs["dp_group"] = dist.group.WORLD
        return prepare(*args, **kwargs)

    return prepare_dynamic_batch
