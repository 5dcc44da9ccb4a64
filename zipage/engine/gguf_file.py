"""A GGUF file, parsed once: its shape, its tensors under HF names, its tokenizer.

llama.cpp's files name tensors their own way (`blk.3.attn_q.weight`) and store Llama's query and
key rows permuted for its RoPE kernel (`convert_hf_to_gguf.py` interleaves the two rotary halves of
every head). `gguf_tensors` dequantises each tensor with the gguf package, undoes that permutation,
and yields it under the checkpoint name `loader.load_weights` expects (`model.layers.3.self_attn.
q_proj.weight`). Going through transformers' GGUF model instead parsed the file three times (config,
tokenizer, weights) and built a float32 HF model only to copy it: 35-70 s for SmolLM2-135M on a
busy 2-core machine, against a few seconds here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from zipage.errors import UnknownModelError
from zipage.shape import ModelShape

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def hf_name(gguf_name: str) -> str:
    """The HF checkpoint name of a GGUF tensor name; a clear error for one we do not know."""
    stem, dot, parameter = gguf_name.rpartition(".")
    if not dot:
        stem, parameter = gguf_name, ""
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{parameter}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parameter}"
    if stem == "rope_freqs":
        raise UnknownModelError(
            f"model: GGUF tensor {gguf_name!r} (Llama 3.1-style RoPE frequency scaling) is not "
            "read from GGUF files; load the model's HF directory instead")
    raise UnknownModelError(f"model: GGUF tensor {gguf_name!r} has no place in our models")


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's per-head query/key row permutation (Llama files only).

    llama.cpp stores each head's rows as pairs (row i, row i + head_dim/2) side by side; HF keeps
    the two halves apart. Rows of head h are [h*head_dim, (h+1)*head_dim)."""
    half = weight.shape[0] // num_heads // 2
    pairs = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return pairs.swapaxes(1, 2).reshape(weight.shape)


def gguf_tensors(reader, shape: ModelShape, path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the open GGUF file as (HF name, float32 CPU tensor)."""
    from gguf.quants import dequantize

    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        try:
            weight = dequantize(tensor.data, tensor.tensor_type)
        except Exception as error:  # noqa: BLE001 - a corrupt or exotic tensor of a user's file
            raise UnknownModelError(f"model: {path}: cannot read GGUF tensor {tensor.name!r} "
                                    f"({error})") from None
        if shape.architecture == "llama" and tensor.name.endswith(("attn_q.weight",
                                                                   "attn_k.weight")):
            heads = shape.num_heads if ".attn_q." in tensor.name else shape.num_kv_heads
            weight = unpermute_rope_rows(weight, heads)
        yield name, torch.from_numpy(np.require(weight, np.float32, ["C", "W"]))


def gguf_tokenizer(path: Path):
    """The file's tokenizer, built by transformers from the tokenizer keys alone.

    `PreTrainedTokenizerFast` reads just the vocabulary, merges, special tokens and chat template
    (a fraction of a second); `AutoTokenizer` would first parse the whole file again for its
    config, only to pick this same class."""
    from transformers import PreTrainedTokenizerFast

    try:
        return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as error:  # noqa: BLE001 - a tokenizer transformers cannot build from the file
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UnknownModelError(f"model: {path}: cannot build its tokenizer ({reason})") from None
