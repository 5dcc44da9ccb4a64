"""The compression pipeline's entry point (docs/architecture.md, 'Compression pipeline').

`compress(...)` compresses a batch of requests over a group of layers; see `kernels/compress_ref.py` for the
exact arguments and semantics. It follows the one dispatch rule (`kernels/dispatch.py`): the Triton kernels of
`compress_triton.py` on CUDA tensors, or on the CPU when `TRITON_INTERPRET=1` is set (the Triton interpreter);
the pure-torch reference otherwise, including on a machine without Triton. The Triton module is imported only
when first needed.
"""

from __future__ import annotations

import dataclasses

import torch

from zipage.kernels.compress_ref import CompressionParams, compress_ref
from zipage.kernels.dispatch import use_triton


@dataclasses.dataclass
class CompressionInputs:
    """One compression batch over a group of layers: the caches it rewrites in place and the
    per-request tables (shapes in `kernels/compress_ref.py`). The one type the engine's compressor,
    the kernel tests and the GPU benchmark build; `arguments` lays it out for `compress`,
    `compress_ref` and `compress_triton`, which share one signature."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    score_cache: torch.Tensor | None
    query_cache: torch.Tensor
    source_tables: torch.Tensor
    num_source_blocks: torch.Tensor
    target_tables: torch.Tensor
    query_slots: torch.Tensor
    is_compressed: torch.Tensor
    # int32 [R]: each request's own number of target blocks (None: all of target_tables' columns);
    # a keyword of `compress`, so not part of `arguments`.
    num_target_blocks: torch.Tensor | None = None

    def arguments(self, params: CompressionParams, scale: float) -> tuple:
        """The positional arguments of `compress`; `num_target_blocks` goes by keyword."""
        return (*(getattr(self, field.name) for field in dataclasses.fields(self)
                  if field.name != "num_target_blocks"), params, scale)

    def clone(self) -> "CompressionInputs":
        """A copy whose caches (what a compression writes) are separate tensors."""
        return dataclasses.replace(
            self, k_cache=self.k_cache.clone(), v_cache=self.v_cache.clone(),
            score_cache=None if self.score_cache is None else self.score_cache.clone())


def compress(k_cache: torch.Tensor, v_cache: torch.Tensor, score_cache: torch.Tensor | None,
             query_cache: torch.Tensor, source_tables: torch.Tensor, num_source_blocks: torch.Tensor,
             target_tables: torch.Tensor, query_slots: torch.Tensor, is_compressed: torch.Tensor,
             params: CompressionParams, scale: float, reduce_group_max=None, *,
             num_target_blocks: torch.Tensor | None = None) -> None:
    """Compress the requests of `source_tables` into `target_tables` (request r into its first
    `num_target_blocks[r]`, all of them when None), in place in the caches."""
    arguments = (k_cache, v_cache, score_cache, query_cache, source_tables, num_source_blocks,
                 target_tables, query_slots, is_compressed, params, scale)
    if reduce_group_max is not None:
        # Tensor parallelism with replicated KV heads: the GQA max spans ranks. The Triton
        # kernels fuse it with the window mean, so only the reference takes the hook.
        compress_ref(*arguments, reduce_group_max, num_target_blocks=num_target_blocks)
        return
    if not use_triton(k_cache):
        compress_ref(*arguments, num_target_blocks=num_target_blocks)
        return
    from zipage.kernels.compress_triton import compress_triton

    compress_triton(*arguments, num_target_blocks=num_target_blocks)


__all__ = ["CompressionParams", "compress"]
