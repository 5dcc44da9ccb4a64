"""A tiny random Qwen3 in HF format, shared by the engine tests: fast on the CPU, every weight
random (norms around 1) so that loading or numerics mistakes cannot hide."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers


def save_tiny_qwen3(directory: Path, weight_std: float = 0.1):
    """Build the model with seed 0, save it as safetensors in `directory`, return the HF model."""
    config = transformers.Qwen3Config(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=128, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(1 + 0.1 * torch.randn_like(parameter))
            else:
                parameter.normal_(0.0, weight_std)
    model.save_pretrained(directory)
    return model.eval()
