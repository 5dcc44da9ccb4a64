"""The compression pipeline's entry point (docs/architecture.md, 'Compression pipeline').

`compress(...)` compresses a batch of requests over a group of layers; see `kernels/compress_ref.py` for the
exact arguments and semantics. It follows paged attention's dispatch rule (`kernels/attention.py`, one copy of
it): the Triton kernels of `compress_triton.py` on CUDA tensors, or on the CPU when `ZIPAGE_FORCE_TRITON=1` or
`TRITON_INTERPRET=1` is set (the Triton interpreter); the pure-torch reference otherwise, including on a machine
without Triton. The Triton module is imported only when first needed.
"""

from __future__ import annotations

import torch

from zipage.kernels.dispatch import use_triton
from zipage.kernels.compress_ref import CompressionParams, compress_ref


def compress(k_cache: torch.Tensor, v_cache: torch.Tensor, score_cache: torch.Tensor | None,
             query_cache: torch.Tensor, source_tables: torch.Tensor, num_source_blocks: torch.Tensor,
             target_tables: torch.Tensor, query_slots: torch.Tensor, is_compressed: torch.Tensor,
             params: CompressionParams, scale: float, reduce_group_max=None) -> None:
    """Compress the requests of `source_tables` into `target_tables`, in place in the caches."""
    arguments = (k_cache, v_cache, score_cache, query_cache, source_tables, num_source_blocks,
                 target_tables, query_slots, is_compressed, params, scale)
    if reduce_group_max is not None:
        # Tensor parallelism with replicated KV heads: the GQA max spans ranks. The Triton
        # kernels fuse it with the window mean, so only the reference takes the hook.
        compress_ref(*arguments, reduce_group_max)
        return
    if not use_triton(k_cache):
        compress_ref(*arguments)
        return
    from zipage.kernels.compress_triton import compress_triton

    compress_triton(*arguments)


__all__ = ["CompressionParams", "compress"]
