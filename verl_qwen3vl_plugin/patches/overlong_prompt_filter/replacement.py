"""verl 0.7.x's overlong-prompt filter, made to count the vision tokens of the prompts it measures.

The filter builds each row's messages with the dataset's ``_build_messages``, which takes the image and video columns
out of the row it is given, and only then looks for those columns to hand the processor: it finds none, and counts
each image as the one placeholder token. During the filter, ``_build_messages`` is given a copy of the row, so the
filter still finds the columns. A deep copy: the messages and image dicts the copy holds are changed too (verl fills
an image dict's ``image`` beside its ``bytes``, which ``process_image`` then refuses).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any


def _from_a_copy(build: Callable, dataset: Any, example: dict, *args: Any, **kwargs: Any) -> Any:
    return build(dataset, copy.deepcopy(example), *args, **kwargs)


def measuring_rows_intact(filter_long: Callable) -> Callable:
    """``RLHFDataset.maybe_filter_out_long_prompts`` whose ``self._build_messages`` reads a copy of each row.

    The instance attribute, not a flag: verl runs the filter in ``num_proc`` worker processes, which get the dataset
    by pickling and so carry the attribute. It is removed when the filter returns, so ``__getitem__`` builds as before.
    """

    @functools.wraps(filter_long)
    def wrapper(self, *args: Any, **kwargs: Any) -> Any:
        self._build_messages = functools.partial(_from_a_copy, type(self)._build_messages, self)
        try:
            return filter_long(self, *args, **kwargs)
        finally:
            del self._build_messages

    return wrapper
