"""The layer attributes verl 0.9's Qwen3.5 forwards read, rebuilt from what transformers >= 5.13 has instead.

transformers >= 5.16 wraps each delta-net kernel in a module-level dispatcher that chose, once at import, between the
package's kernel (FLA, causal-conv1d) and its own torch function; the choice sits in the dispatcher's closure as
``implementation`` and ``torch_function``. Reading it there gives verl exactly the function transformers would call,
under the attribute contract of transformers <= 5.15, where the torch chunked rule takes ``**kwargs`` and ignores
``cu_seqlens`` (the plugin's ``qwen3_5_packed_delta_net`` keeps packed samples apart there).

``layer_attribute`` reads one attribute on a layer of any release; the plugin puts each one a release lacks back on
its class as a read-only property that reads it so (``restored_attribute``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from importlib import import_module

# On the decoder layer: the name verl reads -> the one transformers >= 5.13 gives it.
RENAMED_LAYER_ATTRIBUTES = {"layer_type": "block_type"}
# On the gated delta-net: the kernel attribute verl reads -> transformers' module-level function (>= 5.16).
DELTA_NET_KERNELS = {
    "causal_conv1d_fn": "causal_conv1d_fn",
    "causal_conv1d_update": "causal_conv1d_update",
    "chunk_gated_delta_rule": "torch_chunk_gated_delta_rule",
    "recurrent_gated_delta_rule": "torch_recurrent_gated_delta_rule",
}


@functools.cache
def dispatched_kernel(dispatcher: Callable, none_without_package: bool = False) -> Callable | None:
    """What transformers' kernel ``dispatcher`` calls: the package's kernel if transformers found one at import, else
    its torch function (None with ``none_without_package``). Read once per dispatcher: the choice is fixed."""
    found = inspect.getclosurevars(dispatcher).nonlocals
    if "implementation" not in found or "torch_function" not in found:
        raise RuntimeError(
            f"{dispatcher.__module__}.{dispatcher.__qualname__} is not transformers' kernel dispatcher (no "
            "implementation / torch_function in its closure): its kernel cannot be read"
        )
    if found["implementation"] is not found["torch_function"]:
        return found["implementation"]
    return None if none_without_package else found["torch_function"]


def layer_attribute(layer: object, name: str) -> object:
    """``layer``'s attribute ``name`` as transformers <= 5.12 set it on Qwen3.5's layers, read on any release: the
    layer's own where its ``__init__`` set it; else the one transformers renamed it to (``layer_type`` is
    ``block_type`` from 5.13); else, for a gated delta-net kernel (module-level from 5.16), what transformers'
    dispatcher of it calls, and for ``causal_conv1d_fn`` None without causal-conv1d, as 5.15 set it (its callers
    then run their own convolution)."""
    own = vars(layer)
    if name in own:
        return own[name]
    if name in RENAMED_LAYER_ATTRIBUTES:
        return getattr(layer, RENAMED_LAYER_ATTRIBUTES[name])
    dispatcher = getattr(import_module(type(layer).__module__), DELTA_NET_KERNELS[name])
    return dispatched_kernel(dispatcher, none_without_package=name == "causal_conv1d_fn")


def restored_attribute(name: str) -> property:
    """``name`` put back on a layer class, read-only: what ``layer_attribute`` reads for it."""
    return property(functools.partial(layer_attribute, name=name), doc=f"``{name}`` as transformers <= 5.12 set it")
