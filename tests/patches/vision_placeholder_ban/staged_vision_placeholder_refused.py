"""The agent loop refuses a sample holding an image or video placeholder that no image or video stands behind (one the
rollout engine sampled), with a ValueError naming the token and its position, before it pairs the sequence with
vision features: there transformers >= 5's ``get_rope_index`` raises a bare ``StopIteration`` or ``TypeError``, and
later passes fail on a token count. A placeholder right after ``<|vision_start|>`` pairs as before. A stand-in
processor with Qwen3-VL's special tokens; its ``get_rope_index`` gives text positions. Before the fix the sample
passed on, to fail later without naming its cause."""

import pytest
import torch
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

VISION_START, IMAGE_PAD, VIDEO_PAD, UNKNOWN = 151652, 151655, 151656, 0
PAD = {"image": IMAGE_PAD, "video": VIDEO_PAD}
VOCABULARY = {"<|vision_start|>": VISION_START, "<|image_pad|>": IMAGE_PAD, "<|video_pad|>": VIDEO_PAD}


class Tokenizer:
    unk_token_id = UNKNOWN

    def convert_tokens_to_ids(self, token):
        return VOCABULARY.get(token, UNKNOWN)

    def decode(self, ids):
        return " ".join(map(str, ids))


class Processor:
    tokenizer = Tokenizer()

    def get_rope_index(self, *, input_ids, attention_mask, image_grid_thw, video_grid_thw):
        del attention_mask, image_grid_thw, video_grid_thw
        return torch.arange(input_ids.shape[-1]).expand(3, 1, -1), None


def position_ids(input_ids: list[int]) -> torch.Tensor:
    worker = type("Worker", (), {"processor": Processor()})()
    ids = torch.tensor([input_ids])
    return AgentLoopWorker._compute_position_ids(worker, ids, torch.ones_like(ids), {})


@pytest.mark.parametrize("kind", ["image", "video"])
def test_sampled_vision_placeholder_is_refused_by_name(kind):
    pad = PAD[kind]
    assert position_ids([7, VISION_START, pad, pad, 8, 9]).shape == (1, 4, 6)
    with pytest.raises(ValueError, match=f"holds the {kind} placeholder token {pad} at position 5"):
        position_ids([7, VISION_START, pad, pad, 8, pad, 9])
