"""Qwen2 / Qwen2.5 decoder: Llama with biases on the query, key and value projections."""

from __future__ import annotations

from zipage.engine.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    qkv_bias = True


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_class = Qwen2Attention
