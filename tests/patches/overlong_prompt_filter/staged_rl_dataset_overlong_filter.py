"""``RLHFDataset``'s overlong-prompt filter counts an image prompt's vision tokens: a row with one image whose prompt
is 3 text tokens and 4 image tokens long is kept at ``max_prompt_length`` 7 and dropped at 6. Before the fix the
filter built the messages first, which popped the image column, and measured the prompt as text only (3 tokens).

A processor that counts whitespace-separated words and 4 tokens per image stands for Qwen-VL's; the image loader is
replaced by one that hands the row's image on, so the test needs neither a model nor qwen-vl-utils."""

import io

import datasets
import pytest
import verl.utils.dataset.vision_utils as vision_utils
from omegaconf import OmegaConf
from PIL import Image
from verl.utils.dataset.rl_dataset import RLHFDataset

TOKENS_PER_IMAGE = 4


class WordProcessor:
    """Qwen-VL's processor, reduced to its prompt length: each word is a token, each image 4 more."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **kwargs):
        words = []
        for message in messages:
            content = message["content"]
            parts = [content] if isinstance(content, str) else [p.get("text", "") for p in content]
            words += [w for part in parts for w in part.split()]
        return " ".join(words)

    def __call__(self, text, images=None, videos=None, videos_kwargs=None, **kwargs):
        length = len(text[0].split()) + TOKENS_PER_IMAGE * len(images or [])
        return {"input_ids": [list(range(length))]}


def png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (28, 28)).save(out, format="PNG")
    return out.getvalue()


def rows_kept(tmp_path, max_prompt_length: int) -> int:
    path = tmp_path / f"rows_{max_prompt_length}.parquet"
    row = {"prompt": [{"role": "user", "content": "<image> what is this"}], "images": [{"bytes": png()}]}
    datasets.Dataset.from_list([row]).to_parquet(str(path))
    config = OmegaConf.create(
        {
            "max_prompt_length": max_prompt_length,
            "filter_overlong_prompts": True,
            "filter_overlong_prompts_workers": 1,
            "cache_dir": str(tmp_path / "cache"),
        }
    )
    dataset = RLHFDataset(data_files=str(path), tokenizer=None, config=config, processor=WordProcessor())
    return len(dataset.dataframe)


@pytest.fixture(autouse=True)
def images_as_given(monkeypatch):
    monkeypatch.setattr(vision_utils, "process_image", lambda image, image_patch_size=14: image)


def test_filter_counts_the_image_tokens(tmp_path):
    assert rows_kept(tmp_path, max_prompt_length=3 + TOKENS_PER_IMAGE) == 1
    assert rows_kept(tmp_path, max_prompt_length=3 + TOKENS_PER_IMAGE - 1) == 0
