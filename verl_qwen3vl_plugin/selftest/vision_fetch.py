"""A CPU stand-in for ``qwen_vl_utils`` (test-only): verl's ``process_image`` imports ``fetch_image`` from it, and
``qwen_vl_utils`` imports torchvision at import, which PyPI builds only against torch releases other than the one
these tests pin.

Written from qwen_vl_utils' documented semantics for an image element: the image comes from ``image`` (a PIL image
or a path) and is returned in RGB. The real one also resizes it to multiples of twice the patch size within its
pixel bounds; Qwen's image processor resizes the same way, so the token count of a prompt does not change here.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager

from PIL import Image


def fetch_image(ele: dict, image_patch_size: int = 14) -> Image.Image:
    image = ele["image"]
    if not isinstance(image, Image.Image):
        image = Image.open(image)
    return image.convert("RGB")


def fetch_video(ele: dict, **kwargs) -> None:
    """verl 0.7.0 imports it beside ``fetch_image``; the tests' prompts hold no video, which would need torchvision."""
    raise NotImplementedError("the qwen_vl_utils stand-in reads no video")


@contextmanager
def qwen_vl_utils_stand_in() -> Iterator[types.ModuleType]:
    """``import qwen_vl_utils`` finds the stand-in while the context is open (and in processes forked meanwhile)."""
    module = types.ModuleType("qwen_vl_utils")
    module.fetch_image, module.fetch_video = fetch_image, fetch_video
    saved = sys.modules.get("qwen_vl_utils")
    sys.modules["qwen_vl_utils"] = module
    try:
        yield module
    finally:
        if saved is None:
            del sys.modules["qwen_vl_utils"]
        else:
            sys.modules["qwen_vl_utils"] = saved
