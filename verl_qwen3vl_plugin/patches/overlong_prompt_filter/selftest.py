"""Self-test of ``overlong_prompt_filter``: verl's own ``RLHFDataset._build_messages`` on a geo3k-shaped row (an image
prompt), called as the filter calls it. Under the wrapped filter the row keeps its image column for the processor;
under verl 0.7.x's own it loses it. The whole filter with a processor is in the tests: it needs one built without the
hub."""

from __future__ import annotations

import io

from verl_qwen3vl_plugin.selftest import Check

NAME = "overlong-prompt filter sees the row's images"


def _row() -> dict:
    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (32, 32)).save(png, format="PNG")
    return {"prompt": [{"role": "user", "content": "<image>Find x."}], "images": [{"bytes": png.getvalue()}]}


def _columns_left(filter_long, dataset) -> bool:
    """Whether ``filter_long``'s ``self._build_messages(row)`` leaves the row's image column."""
    row = _row()
    filter_long(dataset, row)
    return "images" in row


def run() -> list[Check]:
    from verl_qwen3vl_plugin.patches.overlong_prompt_filter.spec import DATASET, PATCH
    from verl_qwen3vl_plugin.registry import Verdict, decide_installed

    decision = decide_installed(PATCH, PATCH.targets[0])
    if decision.verdict is not Verdict.APPLY:
        return [
            Check(NAME, decision.verdict is not Verdict.UNRECOGNIZED, f"{decision.verdict.value}: {decision.reason}")
        ]
    from verl.utils.dataset import rl_dataset

    from verl_qwen3vl_plugin.patches.overlong_prompt_filter.replacement import measuring_rows_intact

    dataset = getattr(rl_dataset, DATASET).__new__(getattr(rl_dataset, DATASET))
    dataset.prompt_key, dataset.image_key, dataset.video_key, dataset.processor = "prompt", "images", "videos", object()

    def measure(self, row: dict) -> None:
        self._build_messages(row)

    verl, plugin = _columns_left(measure, dataset), _columns_left(measuring_rows_intact(measure), dataset)
    left = {True: "kept", False: "removed"}
    return [Check(NAME, plugin and not verl, f"image column {left[plugin]} (verl 0.7's own: {left[verl]})")]
