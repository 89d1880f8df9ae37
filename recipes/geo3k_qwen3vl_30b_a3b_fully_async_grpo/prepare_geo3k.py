"""Write geo3k as train/test parquet in the schema verl's RL dataset reads.

Each row: ``data_source`` (selects verl's geo3k reward), ``prompt`` (a chat list whose user turn holds one ``<image>``
placeholder per image, where verl splices the image in), ``images``, ``ability``, ``reward_model.ground_truth`` and
``extra_info``. verl's wheel does not ship its ``examples/`` folder, hence this script.

Usage:
  python prepare_geo3k.py [--source hiyouga/geometry3k] [--output-dir ~/data/geo3k]
``--source`` is a Hugging Face dataset id (downloaded at your site) or a folder written by ``DatasetDict.save_to_disk``.
"""

from __future__ import annotations

import argparse
import os

import datasets

DATA_SOURCE = "hiyouga/geometry3k"  # verl.utils.reward_score routes this name to its geo3k scorer
SPLITS = ("train", "test")
# geo3k's scorer gives 0.9 for a correct \boxed{} answer and 0.1 for the <think>...</think> format.
INSTRUCTION = (
    "Reason step by step inside <think> </think> tags first, then give only the final answer inside \\boxed{}."
)


def to_verl_row(example: dict, index: int, split: str) -> dict:
    problem, images = example["problem"], example["images"]
    placeholders = problem.count("<image>")
    if placeholders == 0:
        problem = "<image>" * len(images) + problem
    elif placeholders != len(images):
        raise ValueError(f"{split}[{index}]: {placeholders} <image> placeholders for {len(images)} images")
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{problem}\n{INSTRUCTION}"}],
        "images": images,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": example["answer"]},
        "extra_info": {"split": split, "index": index, "answer": example["answer"], "question": example["problem"]},
    }


def load(source: str) -> datasets.DatasetDict:
    if os.path.isdir(source):
        return datasets.load_from_disk(source)
    return datasets.load_dataset(source)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default=DATA_SOURCE)
    parser.add_argument("--output-dir", default="~/data/geo3k")
    args = parser.parse_args(argv)
    out = os.path.expanduser(args.output_dir)
    os.makedirs(out, exist_ok=True)
    dataset = load(args.source)
    for split in SPLITS:
        rows = dataset[split].map(
            to_verl_row, with_indices=True, fn_kwargs={"split": split}, remove_columns=dataset[split].column_names
        )
        rows.to_parquet(os.path.join(out, f"{split}.parquet"))
        print(f"{split}: {len(rows)} rows -> {os.path.join(out, f'{split}.parquet')}")


if __name__ == "__main__":
    main()
