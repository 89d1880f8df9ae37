"""The layer attributes verl 0.9's Qwen3.5 forwards read, rebuilt from what transformers >= 5.13 has instead.

transformers >= 5.16 wraps each delta-net kernel in a module-level dispatcher that chose, once at import, between the
package's kernel (FLA, causal-conv1d) and its own torch function; the choice sits in the dispatcher's closure as
``implementation`` and ``torch_function``. Reading it there gives verl exactly the function transformers would call,
under the attribute contract of transformers <= 5.15, where the torch chunked rule takes ``**kwargs`` and ignores
``cu_seqlens`` (the plugin's ``qwen3_5_packed_delta_net`` keeps packed samples apart there).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable


def renamed_attribute(name: str) -> property:
    """A read-only attribute that reads ``name``, the one transformers renamed it to."""
    return property(lambda self: getattr(self, name), doc=f"transformers' ``{name}``, under the name verl reads")


def dispatched_kernel(dispatcher: Callable, none_without_package: bool = False) -> staticmethod | None:
    """What ``dispatcher`` calls: the package's kernel if transformers found one, else its torch function (None with
    ``none_without_package``), as a class attribute."""
    found = inspect.getclosurevars(dispatcher).nonlocals
    if "implementation" not in found or "torch_function" not in found:
        raise RuntimeError(
            f"{dispatcher.__module__}.{dispatcher.__qualname__} is not transformers' kernel dispatcher (no "
            "implementation / torch_function in its closure): its kernel cannot be read"
        )
    if found["implementation"] is not found["torch_function"]:
        return staticmethod(found["implementation"])
    return None if none_without_package else staticmethod(found["torch_function"])
