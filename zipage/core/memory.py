"""The max-concurrency planner: the paper's equation 1 (docs/architecture.md, 'Memory planning').

Given the bytes available for caches, Zipage splits them between KV blocks and query slots so
that every slot can be backed by N_max blocks:

    M       = floor(m_avail / (m_kv * N_max + m_q))      query slots = max concurrency
              (or fewer: at most --query-slots)
    N_total = floor((m_avail - M * m_q) / m_kv)          KV blocks

With compression off (the Full-KV baseline) there are no query slots and every byte holds KV.
Both twins call `plan_memory`, so the same flags give the same blocks and slots in both.
"""

from __future__ import annotations

from dataclasses import dataclass

from zipage.config import ZipageConfig
from zipage.errors import MemoryPlanError
from zipage.shape import ModelShape

GIB = 1024**3
# FP8 KV cache (docs/architecture.md, 'FP8 KV cache'): one byte per element plus one float32 scale
# per (entry, KV head) for K and one for V.
FP8_ELEMENT_BYTES = 1
KV_SCALE_BYTES = 4


def kv_entry_bytes(head_dim: int, kv_cache_dtype: str, dtype_bytes: int) -> int:
    """Bytes one KV entry of one KV head and one layer takes for K (or for V): `head_dim` values in
    the KV element type plus, for fp8, its scale. The planner (m_kv) and the analytic cost model
    (the bytes a step reads) both count with it."""
    if kv_cache_dtype == "fp8":
        return head_dim * FP8_ELEMENT_BYTES + KV_SCALE_BYTES
    return head_dim * dtype_bytes


@dataclass(frozen=True)
class MemoryPlan:
    num_blocks: int  # N_total
    num_query_slots: int  # M (0 with compression off)
    block_bytes: int  # m_kv, including the global-score entries when that is on
    query_slot_bytes: int  # m_q
    available_bytes: int
    # Host slots of the host tier (`--host-kv-gb` over m_kv; 0: none): host memory, not the GPU's.
    num_host_blocks: int = 0

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def query_bytes(self) -> int:
        return self.num_query_slots * self.query_slot_bytes


def kv_token_bytes(shape: ModelShape, kv_cache_dtype: str, dtype_bytes: int, tensor_parallel: int = 1) -> int:
    """K and V of one token over all layers (per GPU), fp8's scales included: what a decode step
    reads a cached entry for, and a block holds `block_size` of."""
    kv_heads = heads_per_gpu(shape.num_kv_heads, tensor_parallel)
    return 2 * shape.num_layers * kv_heads * kv_entry_bytes(shape.head_dim, kv_cache_dtype, dtype_bytes)


def block_bytes(shape: ModelShape, config: ZipageConfig, dtype_bytes: int,
                tensor_parallel: int = 1) -> int:
    """m_kv: K and V of one block over all layers (per GPU), plus its global scores.
    `dtype_bytes` is the compute dtype's; the K/V elements follow `config.kv_cache_dtype`."""
    kv_heads = heads_per_gpu(shape.num_kv_heads, tensor_parallel)
    per_token = kv_token_bytes(shape, config.kv_cache_dtype, dtype_bytes, tensor_parallel)
    if config.keeps_global_scores:
        # One score per (layer, kv head, token), in the compute dtype (also with an fp8 KV
        # cache): the paper's (1 + 1/(2d)).
        per_token += shape.num_layers * kv_heads * dtype_bytes
    return per_token * config.block_size


def query_slot_bytes(shape: ModelShape, config: ZipageConfig, dtype_bytes: int,
                     tensor_parallel: int = 1) -> int:
    """m_q: the w window queries of every layer and query head."""
    heads = heads_per_gpu(shape.num_heads, tensor_parallel)
    return shape.num_layers * config.window * heads * shape.head_dim * dtype_bytes


def plan_memory(shape: ModelShape, config: ZipageConfig, available_bytes: int,
                dtype_bytes: int = 2, tensor_parallel: int = 1) -> MemoryPlan:
    m_kv = block_bytes(shape, config, dtype_bytes, tensor_parallel)
    if not config.compress:
        num_blocks = available_bytes // m_kv
        if num_blocks < 1:
            raise MemoryPlanError(
                f"kv memory: {available_bytes / GIB:.3f} GiB cannot hold one KV block of "
                f"{m_kv / GIB:.3f} GiB; give more memory (--kv-memory-gb) or a smaller --block-size"
            )
        return MemoryPlan(num_blocks, 0, m_kv, 0, available_bytes)
    m_q = query_slot_bytes(shape, config, dtype_bytes, tensor_parallel)
    per_request = m_kv * config.n_max + m_q
    slots = available_bytes // per_request
    if config.query_slots is not None:
        slots = min(slots, config.query_slots)  # capped by the operator: the rest holds KV
    if slots < 1:
        raise MemoryPlanError(
            f"kv memory: {available_bytes / GIB:.3f} GiB cannot hold one request at budget "
            f"{config.kv_budget} ({config.n_max} blocks + a query slot = "
            f"{per_request / GIB:.3f} GiB); give more memory (--kv-memory-gb / "
            f"--gpu-memory-utilization) or a smaller --budget"
        )
    num_blocks = (available_bytes - slots * m_q) // m_kv
    return MemoryPlan(num_blocks, slots, m_kv, m_q, available_bytes)


def weight_bytes(shape: ModelShape, dtype_bytes: int, tensor_parallel: int = 1) -> int:
    return shape.num_params * dtype_bytes // tensor_parallel


def available_kv_bytes(shape: ModelShape, gpu_memory_bytes: int, gpu_memory_utilization: float,
                       dtype_bytes: int = 2, tensor_parallel: int = 1,
                       activation_reserve_bytes: int | None = None) -> int:
    """Bytes left for caches on one GPU once weights and activations are accounted for.

    The real engine measures this after a profiling forward pass; the simulator estimates the
    activation reserve as the peak of one prefill of 16k tokens (hidden states, the fused gate-up
    output and the logits of the sampled rows), which is what a step of our engine allocates.
    """
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise MemoryPlanError(
            f"gpu_memory_utilization: got {gpu_memory_utilization}, expected a fraction in (0, 1]"
        )
    if activation_reserve_bytes is None:
        tokens = 16384
        activation_reserve_bytes = tokens * dtype_bytes * (
            4 * shape.hidden_size + 2 * shape.intermediate_size // tensor_parallel
        ) + 512 * shape.vocab_size * 4
    budget = int(gpu_memory_bytes * gpu_memory_utilization)
    free = budget - weight_bytes(shape, dtype_bytes, tensor_parallel) - activation_reserve_bytes
    if free <= 0:
        raise MemoryPlanError(
            f"gpu memory: {budget / GIB:.1f} GiB usable cannot hold the weights of {shape.name} "
            f"({weight_bytes(shape, dtype_bytes, tensor_parallel) / GIB:.1f} GiB) plus activations; "
            "use a larger GPU, tensor parallelism, or a higher --gpu-memory-utilization"
        )
    return free


def heads_per_gpu(heads: int, tensor_parallel: int) -> int:
    if tensor_parallel < 1:
        raise MemoryPlanError(f"tensor_parallel: got {tensor_parallel}, expected >= 1")
    # KV heads are replicated when there are fewer of them than GPUs (as vLLM does).
    return max(1, heads // tensor_parallel)
