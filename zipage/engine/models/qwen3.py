"""Qwen3 dense decoder: Llama plus an RMSNorm over each query and key head before RoPE (no biases)."""

from __future__ import annotations

import torch

from zipage.engine.layers import RMSNorm
from zipage.engine.models.llama import LlamaAttention, LlamaForCausalLM
from zipage.presets import ModelShape


class Qwen3Attention(LlamaAttention):
    qk_norm = True

    def __init__(self, shape: ModelShape) -> None:
        super().__init__(shape)
        self.q_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps)
        self.k_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps)

    def normalise_query_key(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(query), self.k_norm(key)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_class = Qwen3Attention
