"""Benchmark: verl's ``_get_input_embeds`` (two tower calls on a micro-batch with images and a video) against the
plugin's ``get_input_embeds`` (one call), forward + backward, on the CPU.

Same process, one thread, the two alternating, medians; the model is a small Qwen3-VL with a 4-block tower. No speed
goal: the single call must not be slower than verl's two.

    python benchmarks/vision_call.py [--repeats 9]
    python benchmarks/vision_call.py --smoke   # one repeat: runs, no result
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ["VERL_QWEN3VL_PLUGIN_AUTOLOAD"] = "0"  # verl's own function stays unpatched in this process
os.environ["VERL_USE_EXTERNAL_PLUGINS"] = "none"

import torch  # noqa: E402

BENCH_TOWER = dict(depth=4, hidden_size=128, intermediate_size=512, num_heads=4, deepstack_visual_indexes=[1])
# Per sample: geo3k-sized images, and one sample with a 4-frame video.
CASES = {
    "4 images + 1 video": [[(1, 20, 14)], [(1, 16, 16)], [(1, 24, 18)], [(1, 14, 10), ("v", 4, 16, 16)]],
    "1 image + 1 video": [[(1, 16, 16), ("v", 2, 8, 8)]],
}


def timed(function, model, inputs) -> float:
    start = time.perf_counter()
    out = function(model.model, **inputs)
    loss = out["inputs_embeds"].square().sum() + sum(f.square().sum() for f in out["deepstack_visual_embeds"])
    loss.backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--smoke", action="store_true", help="one repeat")
    args = parser.parse_args()
    if args.smoke:
        args.repeats = 1
    torch.set_num_threads(1)
    from verl.models.transformers import qwen3_vl

    from verl_qwen3vl_plugin.patches.qwen3_vl_single_vision_call.replacement import get_input_embeds
    from verl_qwen3vl_plugin.patches.qwen3_vl_single_vision_call.selftest import model_inputs
    from verl_qwen3vl_plugin.selftest.tiny_models import randomize, tiny_qwen3_vl

    model = randomize(tiny_qwen3_vl(**BENCH_TOWER), seed=0)
    impls = {"verl (2 calls)": qwen3_vl._get_input_embeds, "plugin (1 call)": get_input_embeds}
    if args.smoke:
        print("SMOKE RUN (smallest sizes, one repeat): it checks that the benchmark runs; its times are no result")
    print(f"CPU, 1 thread, forward + backward, medians of {args.repeats} alternating runs")
    for name, samples in CASES.items():
        inputs = model_inputs(samples)
        times = {impl: [] for impl in impls}
        for function in impls.values():  # warm-up
            timed(function, model, inputs)
        for _ in range(args.repeats):
            for impl, function in impls.items():
                model.zero_grad(set_to_none=True)
                times[impl].append(timed(function, model, inputs))
        medians = {impl: statistics.median(t) for impl, t in times.items()}
        verl, plugin = medians.values()
        patches = int(sum(inputs[k].prod(-1).sum() for k in ("image_grid_thw", "video_grid_thw")))
        print(f"  {name} ({patches} patches): verl {verl * 1e3:.1f} ms, plugin {plugin * 1e3:.1f} ms, "
              f"{verl / plugin:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
