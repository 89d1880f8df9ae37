"""What the end-to-end GRPO run trains on, made here with no hub download: a tiny random Qwen3-VL-MoE saved with
``save_pretrained``, a byte-level tokenizer whose special-token ids are the config's, Qwen3-VL's processor and chat
template, and geo3k-style parquet files of image prompts (verl's geo3k rule reward scores them).

The sizes are the smallest vLLM's CPU kernels take: head dims of 32, hidden sizes that are multiples of 64.
"""

from __future__ import annotations

import io
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "recipes" / "geo3k_qwen3vl_30b_a3b_fully_async_grpo"))

from prepare_geo3k import to_verl_row  # noqa: E402  (the recipe's row schema, so the run reads what the recipe does)

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>", "<think>", "</think>"]  # fmt: skip
BYTES = 256  # byte-level vocabulary first, the special tokens after it
VOCAB = BYTES + len(SPECIAL)  # every id the model can sample decodes
PATCH, MERGE = 16, 2
CHAT_TEMPLATE = (
    "{%- for message in messages -%}<|im_start|>{{ message.role }}\n"
    "{%- if message.content is string -%}{{ message.content }}{%- else -%}{%- for item in message.content -%}"
    "{%- if item.type == 'image' or 'image' in item -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif item.type == 'video' or 'video' in item -%}<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif item.type == 'text' -%}{{ item.text }}{%- endif -%}{%- endfor -%}{%- endif -%}<|im_end|>\n"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)


def token_id(name: str) -> int:
    return BYTES + SPECIAL.index(name)


def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))} | {s: token_id(s) for s in SPECIAL}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL)
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE,
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                              "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>"},
    )  # fmt: skip


def config():
    from transformers import Qwen3VLMoeConfig

    text = dict(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        decoder_sparse_step=1, max_position_embeddings=4096, tie_word_embeddings=False, norm_topk_prob=True,
        rope_scaling={"rope_type": "default", "mrope_section": [4, 6, 6], "mrope_interleaved": True},
    )  # fmt: skip
    vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
                  num_position_embeddings=64, deepstack_visual_indexes=[0], patch_size=PATCH,
                  temporal_patch_size=2, spatial_merge_size=MERGE)  # fmt: skip
    return Qwen3VLMoeConfig(
        text_config=text, vision_config=vision, image_token_id=token_id("<|image_pad|>"),
        video_token_id=token_id("<|video_pad|>"), vision_start_token_id=token_id("<|vision_start|>"),
        vision_end_token_id=token_id("<|vision_end|>"), tie_word_embeddings=False,
        bos_token_id=token_id("<|endoftext|>"), eos_token_id=token_id("<|im_end|>"),
        pad_token_id=token_id("<|endoftext|>"),
    )  # fmt: skip


def save_model(path: Path, seed: int = 0) -> None:
    """The model, tokenizer, processor and generation config, as a checkpoint folder verl and vLLM both load."""
    from transformers import GenerationConfig, Qwen3VLMoeForConditionalGeneration, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    torch.manual_seed(seed)
    model = Qwen3VLMoeForConditionalGeneration(config()).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model.generation_config = GenerationConfig(
        eos_token_id=token_id("<|im_end|>"), pad_token_id=token_id("<|endoftext|>")
    )
    model.save_pretrained(path)
    pixels = dict(size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128}, patch_size=PATCH, merge_size=MERGE,
                  temporal_patch_size=2)  # fmt: skip
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**pixels), tokenizer=tokenizer(),
        video_processor=Qwen3VLVideoProcessor(**pixels), chat_template=CHAT_TEMPLATE,
    )  # fmt: skip
    processor.save_pretrained(path)


def image_bytes(rng: random.Random, side: int) -> bytes:
    from PIL import Image

    image = Image.new("RGB", (side, side), tuple(rng.randrange(256) for _ in range(3)))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def save_data(folder: Path, rows: int = 16, seed: int = 0) -> dict[str, Path]:
    """geo3k-style train and test parquet: one image per prompt (a few sizes, so prompts differ in length), a short
    question and a numeric ground truth."""
    import pandas as pd

    rng = random.Random(seed)
    paths = {}
    for split in ("train", "test"):
        examples = [
            {"problem": f"<image>Find x if x + {a} = {a + b}.", "answer": str(b),
             "images": [{"bytes": image_bytes(rng, rng.choice((32, 48, 64))), "path": None}]}
            for a, b in ((rng.randrange(9), rng.randrange(9)) for _ in range(rows))
        ]  # fmt: skip
        paths[split] = folder / f"{split}.parquet"
        pd.DataFrame([to_verl_row(e, i, split) for i, e in enumerate(examples)]).to_parquet(paths[split])
    return paths
