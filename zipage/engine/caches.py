"""The engine's cache memory, sized by the core's memory planner.

K and V for every layer in one allocation ([2, layers, blocks, block_size, kv_heads, head_dim]);
with compression on, the query cache ([layers, slots, window, heads, head_dim]) holding the
observation-window queries and, with the global score, one score per cached entry and KV head
([layers, blocks, block_size, kv_heads]). With `--kv-cache-dtype fp8`, K and V are float8 e4m3
and `kv_scale` ([2, layers, blocks, block_size, kv_heads], float32) holds one scale per entry and
KV head (kernels/kv_quant_ref.py); the query and score caches stay in the compute dtype. The
model runner reads and writes them through its
attention layers; the compressor rewrites them. Neither needs the other to do so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zipage.config import ZipageConfig
from zipage.core.memory import MemoryPlan
from zipage.kernels.kv_quant_ref import FP8_DTYPE
from zipage.shape import ModelShape


@dataclass
class KVCaches:
    kv: torch.Tensor
    query: torch.Tensor | None
    score: torch.Tensor | None
    kv_scale: torch.Tensor | None = None  # fp8: K's and V's scales, [2, layers, blocks, b, kv_heads]

    @property
    def num_layers(self) -> int:
        return self.kv.shape[1]

    @classmethod
    def allocate(cls, shape: ModelShape, capacity: MemoryPlan, config: ZipageConfig,
                 dtype: torch.dtype, device: torch.device) -> "KVCaches":
        fp8 = config.kv_cache_dtype == "fp8"
        kv = torch.zeros(2, shape.num_layers, capacity.num_blocks, config.block_size,
                         shape.num_kv_heads, shape.head_dim, dtype=FP8_DTYPE if fp8 else dtype,
                         device=device)
        # Scale 1 where nothing was written yet: a zero entry dequantizes to zero.
        kv_scale = (torch.ones(2, shape.num_layers, capacity.num_blocks, config.block_size,
                               shape.num_kv_heads, dtype=torch.float32, device=device)
                    if fp8 else None)
        query = score = None
        if config.compress:
            query = torch.zeros(shape.num_layers, capacity.num_query_slots, config.window,
                                shape.num_heads, shape.head_dim, dtype=dtype, device=device)
            if config.keeps_global_scores:
                # In the KV dtype: the memory planner counts it in every block (the paper's
                # 1 + 1/(2d) factor).
                score = torch.zeros(shape.num_layers, capacity.num_blocks, config.block_size,
                                    shape.num_kv_heads, dtype=dtype, device=device)
        return cls(kv, query, score, kv_scale)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (K, V and scores of every layer), source -> destination: a fork's
        copy of its leader's last, partial prompt block (`StepPlan.block_copies`)."""
        if not copies:
            return
        device = self.kv.device
        sources = torch.tensor([source for source, _ in copies], device=device)
        targets = torch.tensor([target for _, target in copies], device=device)
        self.kv[:, :, targets] = self.kv[:, :, sources]
        if self.kv_scale is not None:
            self.kv_scale[:, :, targets] = self.kv_scale[:, :, sources]
        if self.score is not None:
            self.score[:, targets] = self.score[:, sources]

    def layer_scales(self, layer) -> dict:
        """The keywords an attention or compression kernel takes for layer (or slice of layers)
        `layer`: the fp8 scales, or nothing for a cache in the compute dtype."""
        if self.kv_scale is None:
            return {}
        return {"k_scale": self.kv_scale[0, layer], "v_scale": self.kv_scale[1, layer]}
