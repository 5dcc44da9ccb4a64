"""When a kernel call runs Triton and when it runs the pure-torch reference: the one rule.

Triton runs on CUDA tensors, or on the CPU when TRITON_INTERPRET=1 (the Triton interpreter, which
the tests use); everything else — and any machine without Triton — runs the reference, which is
also the test oracle.
"""

from __future__ import annotations

import importlib.util
import os

import torch

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def use_triton(tensor: torch.Tensor) -> bool:
    if not TRITON_AVAILABLE:
        return False
    return tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
