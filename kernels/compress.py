"""The compression pipeline's entry point (DESIGN.md section 7).

`compress(...)` compresses a batch of requests over a group of layers; see
`kernels/compress_ref.py` for the exact arguments and semantics. It runs the pure-torch reference
everywhere for now: the Triton kernels plug in here, on CUDA tensors, with the same signature.
"""

from __future__ import annotations

from .compress_ref import CompressionParams, compress_ref

compress = compress_ref

__all__ = ["CompressionParams", "compress"]
