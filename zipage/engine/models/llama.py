"""Llama decoder (Llama 2/3.x, SmolLM2, DeepSeek-R1-Distill-Llama), the base the Qwen models extend.

Pre-norm decoder layers: RMSNorm -> GQA attention with RoPE over the paged KV cache -> residual,
RMSNorm -> SwiGLU MLP -> residual. Query/key/value and gate/up projections are fused into one matmul
each, and each residual add is fused into the norm that follows it: a layer takes and returns the
residual stream beside its output, and the next norm adds the two (Nano-vLLM's layout). Module names
mirror HF's (`model.layers.N.self_attn...`) so that the loader only has to map the fused projections.
Qwen2 and Qwen3 subclass the attention block; everything else is shared.

Tensor parallelism (Megatron's layout) needs no other code: a rank builds the model from its
shard's shape (`zipage/engine/sharding.py`: its query and KV heads, its slice of the MLP), the
column-parallel q/k/v and gate/up projections need no communication, the row-parallel o_proj and
down_proj all-reduce, and the embedding and LM head split the vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zipage.engine.context import get_context
from zipage.engine.distributed import gather_vocab
from zipage.engine.layers import (
    Embedding,
    GateUpLinear,
    PagedAttention,
    QKVLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelLinear,
    rotary_qk,
    silu_and_mul,
)
from zipage.shape import ModelShape


class LlamaAttention(nn.Module):
    """Grouped-query self-attention; subclasses change the q/k/v biases and per-head q/k norms."""

    qkv_bias = False
    qk_norm = False

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.num_heads = shape.num_heads
        self.num_kv_heads = shape.num_kv_heads
        self.head_dim = shape.head_dim
        self.qkv_proj = QKVLinear(
            shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim, bias=self.qkv_bias
        )
        self.o_proj = RowParallelLinear(shape.num_heads * shape.head_dim, shape.hidden_size)
        self.attn = PagedAttention(shape.num_heads, shape.num_kv_heads, shape.head_dim)

    def rotate_query_key(
        self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE of the per-head queries and keys, one kernel for both; Qwen3 also normalises each head first."""
        return rotary_qk(query, key, cos, sin)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        query_size = self.num_heads * self.head_dim
        key_value_size = self.num_kv_heads * self.head_dim
        query, key, value = self.qkv_proj(hidden).split([query_size, key_value_size, key_value_size], dim=-1)
        query = query.reshape(-1, self.num_heads, self.head_dim)
        key = key.reshape(-1, self.num_kv_heads, self.head_dim)
        value = value.reshape(-1, self.num_kv_heads, self.head_dim)
        query, key = self.rotate_query_key(query, key, cos, sin)
        out = self.attn(query, key, value)
        return self.o_proj(out.reshape(-1, query_size))


class LlamaMLP(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.gate_up_proj = GateUpLinear(shape.hidden_size, shape.intermediate_size)
        self.down_proj = RowParallelLinear(shape.intermediate_size, shape.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(hidden)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape, attention_class: type[LlamaAttention]) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = attention_class(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = LlamaMLP(shape)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden` is the previous layer's MLP output, still to be added to the residual stream `residual`
        (None before the first layer, whose `hidden` is the embedding: the stream starts there). Returns this
        layer's MLP output and the stream, for the next layer's norm to add up."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, shape: ModelShape, attention_class: type[LlamaAttention]) -> None:
        super().__init__()
        self.embed_tokens = Embedding(shape.vocab_size, shape.hidden_size)
        self.rotary_emb = RotaryEmbedding(shape.head_dim, shape.max_position, shape.rope_theta, shape.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(shape, attention_class) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary_emb(positions)  # looked up once, shared by every layer
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """The decoder plus the LM head (absent when tied: the logits then use the embedding matrix).

    The runner calls `forward(input_ids, positions)` with the forward context set, then
    `compute_logits` on the result; `attention_layers()` lists the modules it hands caches to.
    """

    attention_class: type[LlamaAttention] = LlamaAttention

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        if (shape.qkv_bias, shape.qk_norm) != (self.attention_class.qkv_bias, self.attention_class.qk_norm):
            raise ValueError(
                f"{shape.name}: qkv_bias={shape.qkv_bias}, qk_norm={shape.qk_norm} do not match the "
                f"{shape.architecture} architecture"
            )
        self.shape = shape
        self.model = LlamaModel(shape, self.attention_class)
        self.lm_head = (None if shape.tie_embeddings
                        else VocabParallelLinear(shape.hidden_size, shape.vocab_size))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids and positions int64 [num_tokens] -> final hidden states [num_tokens, hidden_size].

        `positions` are true token positions (prompt length + tokens generated so far - 1 for a decode
        token), independent of where the token's KV lands after compression (docs/architecture.md, 'Rules', rule 4).
        """
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [num_sampled, vocab_size] of the rows that sample a token this step: the context's
        `logits_indices` (the runner's: sampling chunks' last rows, then decode rows), else each
        prefill sequence's last row, else every row (decode)."""
        context = get_context()
        if context.logits_indices is not None:
            hidden = hidden.index_select(0, context.logits_indices)  # no host sync: graph-safe
        elif context.is_prefill:
            hidden = hidden[context.cu_seqlens_q[1:].long() - 1]
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        # Under tensor parallelism each rank computes its vocabulary shard's logits.
        return gather_vocab(F.linear(hidden, weight), self.shape.vocab_size)

    def attention_layers(self) -> list[PagedAttention]:
        """One per decoder layer, in order: the runner assigns each its KV (and query) cache views."""
        return [layer.self_attn.attn for layer in self.model.layers]
