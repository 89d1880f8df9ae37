"""Runs at every interpreter start in the e2e venv (the .pth): stays cheap, imports nothing heavy.

- torchvision: PyPI's torchvision 0.28 is a CUDA build whose compiled ops do not load beside the CPU torch, and its
  ``_meta_registrations`` then fails on ``register_fake("torchvision::nms")`` for an operator that was never
  defined. transformers' and vLLM's Qwen3-VL code and qwen-vl-utils need only its Python transforms. Defining the two
  schemas first lets ``import torchvision`` finish; its compiled ops stay unavailable (nothing here calls them).
"""

from __future__ import annotations

import importlib.abc
import sys

TORCHVISION_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_libraries = []  # keep the definitions alive


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        if not hasattr(torch.ops.torchvision, "nms"):
            library = torch.library.Library("torchvision", "DEF")
            for schema in TORCHVISION_SCHEMAS:
                library.define(schema)
            _libraries.append(library)
        return None  # the regular finders import torchvision itself


sys.meta_path.insert(0, _BeforeTorchvision())
