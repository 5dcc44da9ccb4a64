"""Qwen3 dense decoder: Llama plus an RMSNorm over each query and key head before RoPE (no biases)."""

from __future__ import annotations

import torch

from zipage.engine.layers import RMSNorm, rotary_qk
from zipage.engine.models.llama import LlamaAttention, LlamaForCausalLM
from zipage.shape import ModelShape


class Qwen3Attention(LlamaAttention):
    qk_norm = True

    def __init__(self, shape: ModelShape) -> None:
        super().__init__(shape)
        # Hold the checkpoints' q_norm / k_norm weights; the rotary kernel applies them, fused with RoPE.
        self.q_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps)
        self.k_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps)

    def rotate_query_key(
        self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_qk(query, key, cos, sin, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_class = Qwen3Attention
