"""verl 0.7.x's own ``RLHFDataset`` filtering one geo3k-shaped image prompt (the e2e run's rows,
``tests/e2e/artefacts.py``) with Qwen3-VL's processor over a byte-level tokenizer, as a user's process runs it (the
plugin active unless the environment disables it).

Prints one JSON object: the prompt's tokenized length and its image's tokens, as the rollout tokenizes them (the
messages verl builds, the image through verl's ``process_image``), and how many rows the filter keeps at
``max_prompt_length`` = that length minus 0, 1, image tokens - 1 and image tokens (and minus 1 with two filter
workers).

``qwen_vl_utils`` cannot import here (it needs torchvision): the package's stand-in (``selftest/vision_fetch.py``)
serves verl's ``process_image``.
"""

import copy
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository, for tests.e2e

import verl  # noqa: E402, F401  (the plugin activates here, as in a user's process)

from tests.e2e import artefacts  # noqa: E402
from verl_qwen3vl_plugin import patch_statuses  # noqa: E402
from verl_qwen3vl_plugin.selftest.vision_fetch import qwen_vl_utils_stand_in  # noqa: E402


def processor():
    """Qwen3-VL's processor, the tiny model's sizes, without the video processor: transformers refuses to build one
    without torchvision, and image prompts never call it."""
    from transformers import Qwen2TokenizerFast, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    class ImageProcessorOnly(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name != "video_processor":
                return super().check_argument_for_proper_class(argument_name, argument)

    tokens = artefacts.tokenizer()
    tokenizer = Qwen2TokenizerFast(
        tokenizer_object=tokens.backend_tokenizer, eos_token=tokens.eos_token, pad_token=tokens.pad_token,
        chat_template=artefacts.CHAT_TEMPLATE,
    )  # fmt: skip
    images = Qwen2VLImageProcessor(
        patch_size=artefacts.PATCH, merge_size=artefacts.MERGE, temporal_patch_size=2,
        size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128},
    )  # fmt: skip
    return ImageProcessorOnly(
        image_processor=images, tokenizer=tokenizer, video_processor=None, chat_template=artefacts.CHAT_TEMPLATE
    )


def dataset(path: Path, proc, max_length: int, filter_on: bool = True, workers: int = 1):
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    config = OmegaConf.create({
        "max_prompt_length": max_length, "filter_overlong_prompts": filter_on, "image_key": "images",
        "prompt_key": "prompt", "filter_overlong_prompts_workers": workers,
    })  # fmt: skip
    return RLHFDataset(data_files=str(path), tokenizer=proc.tokenizer, processor=proc, config=config)


def tokenized_length(path: Path, proc) -> tuple[int, int]:
    from verl.utils.dataset.vision_utils import process_image

    full = dataset(path, proc, 10**6, filter_on=False)
    row = full.dataframe[0]
    raw = proc.apply_chat_template(full._build_messages(copy.deepcopy(row)), add_generation_prompt=True, tokenize=False)
    ids = proc(text=[raw], images=[process_image(row["images"][0])])["input_ids"][0]
    return len(ids), sum(int(i) == artefacts.token_id("<|image_pad|>") for i in ids)


def main() -> None:
    proc = processor()
    with tempfile.TemporaryDirectory() as tmp, qwen_vl_utils_stand_in():
        path = artefacts.save_data(Path(tmp), rows=1, seed=1)["train"]
        length, image_tokens = tokenized_length(path, proc)
        kept = {
            str(below): len(dataset(path, proc, length - below)) for below in (0, 1, image_tokens - 1, image_tokens)
        }
        kept["1, 2 workers"] = len(dataset(path, proc, length - 1, workers=2))
    print(
        json.dumps(
            {
                "length": length,
                "image_tokens": image_tokens,
                "kept": kept,
                "statuses": {f"{s.patch} {s.target}": s.status.value for s in patch_statuses()},
            }
        )
    )


if __name__ == "__main__":
    main()
