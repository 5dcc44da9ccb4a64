"""A model's shape: the architecture facts the memory planner, the simulator and the engine need.

The core takes a shape, not a model file; `zipage.presets` names shapes and reads them from HF
directories and GGUF files.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class ModelShape:
    """The architecture facts a decoder-only transformer is built (or simulated) from."""

    name: str
    architecture: str  # "qwen3" | "qwen2" | "llama"
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    # Llama 3.x style frequency scaling, as in HF's `rope_scaling` dict; empty means none.
    rope_scaling: dict = field(default_factory=dict)
    qkv_bias: bool = False  # qwen2 has biases on q/k/v projections
    qk_norm: bool = False  # qwen3 normalises q and k per head before RoPE

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (q + 2 * kv) + q * self.hidden_size
        if self.qkv_bias:
            attention += q + 2 * kv
        mlp = 3 * self.hidden_size * self.intermediate_size
        norms = 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        per_layer = attention + mlp + norms
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + embeddings + self.hidden_size

    def scaled(self, **changes) -> "ModelShape":
        return replace(self, **changes)
