"""The building blocks our decoder models are made of: norms, rotary embeddings, fused linears, attention.

Every layer works on flattened batches: activations are [num_tokens, ...] with the tokens of all
sequences of a step side by side, and the batch layout comes from the forward context
(`zipage.engine.context`). Parameters are created uninitialised (`torch.empty`) on whatever device
and default dtype the caller has set, because the loader always overwrites them: from a checkpoint or
with seeded random values. The maths follows the HF reference implementations of Llama, Qwen2 and
Qwen3 so that greedy decoding matches them token for token in float32. The elementwise maths (norms, the
residual adds, RoPE, SwiGLU) runs as fused kernels of `zipage.kernels.fused_ops`, a few launches per layer
instead of dozens; on the CPU those are the torch references, bit-identical to the unfused HF code.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from zipage.engine.context import get_context
from zipage.engine.distributed import all_reduce, get_shard_group
from zipage.kernels.attention import paged_decode_attention, paged_prefill_attention, store_kv, store_queries

# rotary_qk and silu_and_mul are used by the models, which take all their building blocks from this module.
from zipage.kernels.fused_ops import add_rms_norm, rms_norm, rotary_qk, silu_and_mul  # noqa: F401
from zipage.model_spec import ROPE_TYPES

# RoPE variants we implement (HF's `rope_type`); "default" is plain RoPE. Dynamic NTK and LongRoPE change
# the frequencies with the sequence length, which cached (already rotated) keys cannot follow.


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back before the scale, as HF does.

    Given the residual stream too, it first adds `x` (a sublayer's output) to it, in the same kernel, and
    returns the normalised sum with the new stream: `hidden, residual = norm(hidden, residual)`.
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


def rope_inverse_frequencies(
    head_dim: int, rope_theta: float, rope_scaling: dict, max_position: int
) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies [head_dim / 2] (float32) and the factor cos/sin are scaled by.

    `rope_scaling` is HF's dict (`rope_type` plus that type's parameters); empty means plain RoPE.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inverse_frequencies = 1.0 / (rope_theta**exponents)
    rope_type = rope_scaling.get("rope_type", "default")
    if rope_type == "default":
        return inverse_frequencies, 1.0
    factor = float(rope_scaling["factor"])
    if rope_type == "linear":
        return inverse_frequencies / factor, 1.0
    if rope_type == "llama3":
        return _llama3_frequencies(inverse_frequencies, rope_scaling, factor), 1.0
    if rope_type == "yarn":
        return _yarn_frequencies(inverse_frequencies, rope_scaling, factor, rope_theta, max_position)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")


def _llama3_frequencies(inverse_frequencies: torch.Tensor, scaling: dict, factor: float) -> torch.Tensor:
    """Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended."""
    original_context = scaling["original_max_position_embeddings"]
    low_frequency_wavelength = original_context / scaling["low_freq_factor"]
    high_frequency_wavelength = original_context / scaling["high_freq_factor"]
    wavelengths = 2 * math.pi / inverse_frequencies
    scaled = torch.where(wavelengths > low_frequency_wavelength, inverse_frequencies / factor, inverse_frequencies)
    smooth = (original_context / wavelengths - scaling["low_freq_factor"]) / (
        scaling["high_freq_factor"] - scaling["low_freq_factor"]
    )
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelengths >= high_frequency_wavelength) & (wavelengths <= low_frequency_wavelength)
    return torch.where(in_band, blended, scaled)


def _yarn_frequencies(
    inverse_frequencies: torch.Tensor, scaling: dict, factor: float, rope_theta: float, max_position: int
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate the low frequencies, keep the high ones, ramp between; scale cos/sin up."""
    head_dim = 2 * inverse_frequencies.numel()
    original_context = scaling.get("original_max_position_embeddings", max_position)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor, 1.0)

    def dimension_of(rotations: float) -> float:
        """The dimension index whose wavelength completes `rotations` turns over the original context."""
        return head_dim * math.log(original_context / (rotations * 2 * math.pi)) / (2 * math.log(rope_theta))

    low = dimension_of(scaling.get("beta_fast") or 32)
    high = dimension_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep_original = 1 - ramp
    frequencies = inverse_frequencies / factor * (1 - keep_original) + inverse_frequencies * keep_original
    return frequencies, float(attention_factor)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables for every position up to `max_position`, looked up by true position.

    Tables stay float32: rotation happens before keys are cached, so its precision is paid once per token.
    """

    def __init__(self, head_dim: int, max_position: int, rope_theta: float, rope_scaling: dict) -> None:
        super().__init__()
        inverse_frequencies, attention_factor = rope_inverse_frequencies(
            head_dim, rope_theta, rope_scaling, max_position
        )
        # Built where the model is being built (the loader's `torch.device` context), not moved there later.
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inverse_frequencies)
        self.register_buffer("cos", angles.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", angles.sin() * attention_factor, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [num_tokens, head_dim / 2] of each token's position, as `rotary_qk` takes them."""
        return self.cos[positions], self.sin[positions]


class Linear(nn.Module):
    """y = x W^T (+ b), with uninitialised parameters that the loader fills."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(Linear):
    """A linear whose input features are split across tensor-parallel ranks (attention output,
    MLP down projection): each rank's product is a partial sum, all-reduced before the bias."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelLinear(Linear):
    """The LM head, its vocabulary rows split across ranks; `gather` assembles the full logits."""

    def __init__(self, input_size: int, vocab_size: int) -> None:
        _, rows = get_shard_group().vocab_rows(vocab_size)
        super().__init__(input_size, rows)
        self.vocab_size = vocab_size


class FusedLinear(Linear):
    """Several projections of the same input computed by one matmul; their outputs are concatenated.

    Checkpoints store the projections separately (q_proj, k_proj, ...): the loader copies each into
    its rows of the fused parameter, found with `shard_view`.
    """

    def __init__(self, input_size: int, shard_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__(input_size, sum(shard_sizes.values()), bias)
        self.shard_rows: dict[str, tuple[int, int]] = {}
        start = 0
        for shard, size in shard_sizes.items():
            self.shard_rows[shard] = (start, size)
            start += size

    def shard_view(self, parameter_name: str, shard: str) -> torch.Tensor:
        """The rows of parameter `parameter_name` ("weight" or "bias") that projection `shard` owns."""
        start, size = self.shard_rows[shard]
        return getattr(self, parameter_name).data.narrow(0, start, size)


class QKVLinear(FusedLinear):
    """The query, key and value projections as one matmul; outputs [q | k | v]."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool) -> None:
        super().__init__(
            hidden_size, {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}, bias
        )


class GateUpLinear(FusedLinear):
    """The SwiGLU gate and up projections as one matmul; outputs [gate | up]."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__(hidden_size, {"gate": intermediate_size, "up": intermediate_size})


class Embedding(nn.Module):
    """Token id -> embedding row. Under tensor parallelism each rank holds a slice of the
    vocabulary (`ShardGroup.vocab_rows`): ids outside it look up zeros, and the all-reduce sums
    the one rank's row that holds each id."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_start, rows = get_shard_group().vocab_rows(vocab_size)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if get_shard_group().world == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(torch.where(inside, local, 0), self.weight)
        return all_reduce(rows * inside[:, None].to(rows.dtype))


class PagedAttention(nn.Module):
    """Stores this step's keys and values in the paged KV cache, then attends over the cache.

    The runner assigns `k_cache` and `v_cache` ([num_blocks, block_size, num_kv_heads, head_dim]) and, when
    compression is on, `query_cache` ([num_slots, window, num_heads, head_dim]) — views into its big
    per-model tensors — before the first forward. Keys arrive already rotated: RoPE is applied before
    caching (docs/architecture.md, 'Rules', rule 4), so attention never needs positions.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.query_cache = torch.empty(0)
        # An fp8 cache's scales (`KVCaches.layer_scales`): k_scale, v_scale; empty otherwise.
        self.kv_scales: dict = {}

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """query [num_tokens, num_heads, head_dim], key/value [num_tokens, num_kv_heads, head_dim] -> like query."""
        context = get_context()
        store_kv(key, value, self.k_cache, self.v_cache, context.slot_mapping, **self.kv_scales)
        if context.query_slot_mapping is not None:
            store_queries(query, self.query_cache, context.query_slot_mapping)
        if not context.is_prefill:
            return paged_decode_attention(
                query, self.k_cache, self.v_cache, context.context_lens, context.block_tables, self.scale,
                split=context.decode_split, **self.kv_scales,
            )
        if context.decode_section is not None:
            return self._prefill_with_section(query, context)
        if context.decode_context_lens is None:
            return self._prefill(query, context)
        # A mixed step: the chunk rows through the varlen prefill kernel, the decode rows through the
        # split-K decode kernel (docs/kernels.md, 'Mixed steps'). Every row's KV is stored above, so
        # neither kernel reads an entry this step has yet to write.
        rows = context.num_prefill_tokens
        chunks = self._prefill(query[:rows], context)
        decoded = paged_decode_attention(
            query[rows:], self.k_cache, self.v_cache, context.decode_context_lens,
            context.decode_block_tables, self.scale, **self.kv_scales,
        )
        return torch.cat((chunks, decoded))

    def _prefill_with_section(self, query: torch.Tensor, context) -> torch.Tensor:
        """A padded step: the prefill launch over every row with work items, then the decode
        section's rows (none of them in that launch's work) through the split-K decode kernel,
        put back in place. An empty slot names a chunk row and rewrites its own output, so what
        the graph computes does not depend on how many slots a step fills."""
        out = self._prefill(query, context)
        section = context.decode_section
        decoded = paged_decode_attention(
            query.index_select(0, section.rows), self.k_cache, self.v_cache, section.context_lens,
            section.block_tables, self.scale, grid_batch=section.grid_batch, **self.kv_scales,
        )
        kept = torch.where(section.filled, decoded, out.index_select(0, section.rows))
        return out.index_copy_(0, section.rows, kept)

    def _prefill(self, query: torch.Tensor, context) -> torch.Tensor:
        return paged_prefill_attention(
            query, self.k_cache, self.v_cache, context.cu_seqlens_q, context.context_lens,
            context.block_tables, self.scale, context.max_q_len, context.prefill_work, **self.kv_scales,
        )
