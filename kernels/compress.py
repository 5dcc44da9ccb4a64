"""The compression pipeline's entry point (docs/architecture.md, 'Compression pipeline').

`compress(...)` compresses a batch of requests over a group of layers; see `kernels/compress_ref.py` for the
exact arguments and semantics. The scoring policy `params.scoring` (`kernels/scoring`) ranks the entries. It
follows the one dispatch rule (`kernels/dispatch.py`): the policy's fast path (the Triton kernels of
`compress_triton.py` for the default) on CUDA tensors, or on the CPU when `TRITON_INTERPRET=1` is set (the Triton
interpreter); the pure-torch reference otherwise, for a policy without a fast path, and on a machine without
Triton. The Triton module is imported only when first needed.
"""

from __future__ import annotations

import dataclasses

import torch

from zipage.kernels.compress_ref import CompressionParams, compress_ref
from zipage.kernels.dispatch import use_triton
from zipage.kernels.scoring import scoring_policy


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
    # float32 [L, num_blocks, b, Hkv]: an fp8 cache's scales (kernels/kv_quant_ref.py); keywords too.
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    # int64 [R]: each compression's own seed (the random scoring policy's); a keyword too.
    seeds: torch.Tensor | None = None

    def arguments(self, params: CompressionParams, scale: float) -> tuple:
        """The positional arguments of `compress`; `num_target_blocks` and the scales go by keyword."""
        return (*(getattr(self, field.name) for field in dataclasses.fields(self)
                  if field.name not in _KEYWORDS), params, scale)

    def keywords(self) -> dict:
        """The keyword arguments of `compress`; the fp8 scales only where the cache has them, so a
        compress_fn of a baseline policy that knows no scales keeps working on other caches."""
        values = {"num_target_blocks": self.num_target_blocks}
        if self.k_scale is not None:
            values.update(k_scale=self.k_scale, v_scale=self.v_scale)
        if self.seeds is not None:
            values.update(seeds=self.seeds)
        return values

    def clone(self) -> "CompressionInputs":
        """A copy whose caches (what a compression writes) are separate tensors."""
        return dataclasses.replace(
            self, k_cache=self.k_cache.clone(), v_cache=self.v_cache.clone(),
            score_cache=None if self.score_cache is None else self.score_cache.clone(),
            k_scale=None if self.k_scale is None else self.k_scale.clone(),
            v_scale=None if self.v_scale is None else self.v_scale.clone())


_KEYWORDS = ("num_target_blocks", "k_scale", "v_scale", "seeds")


def compress(k_cache: torch.Tensor, v_cache: torch.Tensor, score_cache: torch.Tensor | None,
             query_cache: torch.Tensor, source_tables: torch.Tensor, num_source_blocks: torch.Tensor,
             target_tables: torch.Tensor, query_slots: torch.Tensor, is_compressed: torch.Tensor,
             params: CompressionParams, scale: float, reduce_group_max=None, *,
             num_target_blocks: torch.Tensor | None = None,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
             seeds: torch.Tensor | None = None) -> None:
    """Compress the requests of `source_tables` into `target_tables` (request r into its first
    `num_target_blocks[r]`, all of them when None), in place in the caches, keeping the entries
    the scoring policy `params.scoring` ranks highest; an fp8 cache comes with its scales
    `k_scale`/`v_scale`; `seeds` [R] seed each compression (the random policy)."""
    policy = scoring_policy(params.scoring)
    params = policy.fixed(params)
    # Only for an fp8 cache: a cache in the compute dtype makes the call it always made.
    scales = {} if k_scale is None and v_scale is None else dict(k_scale=k_scale, v_scale=v_scale)
    arguments = (k_cache, v_cache, score_cache, query_cache, source_tables, num_source_blocks,
                 target_tables, query_slots, is_compressed, params, scale)
    if reduce_group_max is not None:
        # Tensor parallelism with replicated KV heads: the GQA max spans ranks. The Triton
        # kernels fuse it with the window mean, so only the reference takes the hook.
        compress_ref(*arguments, reduce_group_max, num_target_blocks=num_target_blocks, **scales,
                     seeds=seeds, scorer=policy.reference)
        return
    if policy.triton is None or not use_triton(k_cache):
        compress_ref(*arguments, num_target_blocks=num_target_blocks, **scales, seeds=seeds,
                     scorer=policy.reference)
        return
    policy.triton(*arguments, num_target_blocks=num_target_blocks, **scales, seeds=seeds)


__all__ = ["CompressionParams", "compress"]
