"""Where FP8 Full KV's disagreement comes from (issue #34; docs/BENCHMARKS.md, 'FP8 KV cache').

Emulates a cache format in the compute-dtype cache: every key and value the attention layers store goes
through the format's round trip first (quantize, dequantize), so the attention kernels, the batch and the
reference are the engine's own and only the stored numbers differ. Full KV, teacher-forced against the same
Full KV reference as bench/fp8_quality.py (SmolLM2-135M-Instruct, sampled continuation), one row per format:
- `e4m3 K and V`: the engine's FP8 cache (`kv_quant_ref.quantize_kv`: a scale per entry and KV head,
  searched); it should match bench/fp8_quality.py's FP8 Full KV row within noise;
- `e4m3 K only` / `e4m3 V only`: which of the two costs the flips;
- `e4m3, first 16 entries exact`: the attention sinks kept in the compute dtype;
- `e4m3 after a Hadamard rotation`: q, k and v rotated by a randomized Hadamard matrix after RoPE (attention
  and the compression scores do not see an orthogonal rotation), spreading outlier channels;
- `int8 K and V`: a symmetric int8 per entry and KV head (scale amax / 127), the same bytes as e4m3;
- `bfloat16 K and V`: the 2-byte cache (meaningful with `--dtype float32`).

Run: `python bench/fp8_error_sources.py [--new-tokens 1024] [--num-prompts 4] [--device cpu|cuda]
[--dtype float32|bfloat16]`. Prints one markdown table (agreement, disagreement in points, KL).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable

import torch
from fp8_quality import BLOCK_SIZE, common_parser, force, load

from zipage.analysis.fidelity import build_engine, generate_reference
from zipage.config import ZipageConfig
from zipage.engine import layers
from zipage.engine.context import get_context
from zipage.kernels.kv_quant_ref import quantize_kv

SINKS = 16


def e4m3(x: torch.Tensor) -> torch.Tensor:
    values, scale = quantize_kv(x.float())
    return (values.float() * scale[..., None]).to(x.dtype)


def int8(x: torch.Tensor) -> torch.Tensor:
    scale = x.float().abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
    return ((x.float() / scale).round().clamp(-127, 127) * scale).to(x.dtype)


def positions() -> torch.Tensor:
    """Each stored row's position in its sequence, from the step's forward context."""
    context = get_context()
    if not context.is_prefill:
        return context.context_lens.long() - 1
    starts = context.cu_seqlens_q.long()
    lengths = context.context_lens.long()
    rows = [torch.arange(int(starts[s]), int(starts[s + 1]), device=starts.device) - int(starts[s + 1])
            + int(lengths[s]) for s in range(len(starts) - 1)]
    if context.decode_context_lens is not None:
        rows.append(context.decode_context_lens.long() - 1)
    return torch.cat(rows)


@functools.cache
def hadamard(size: int, device: torch.device, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A randomized Hadamard matrix (orthogonal): Sylvester's construction, columns' signs flipped at random
    (one per shape, device and dtype: every layer of every step asks)."""
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < size:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)])
    signs = torch.randint(0, 2, (size,), generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return (matrix * signs / math.sqrt(size)).to(device, dtype)


Forward = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _sinks_exact(forward: Forward, module, query, key, value):
    exact = (positions() < SINKS)[:, None, None]
    return forward(module, query, torch.where(exact, key, e4m3(key)), torch.where(exact, value, e4m3(value)))


def _rotated(forward: Forward, module, query, key, value):
    rotation = hadamard(key.shape[-1], key.device, key.dtype)
    return forward(module, query @ rotation, e4m3(key @ rotation), e4m3(value @ rotation)) @ rotation.T


# Each format: PagedAttention.forward's arguments -> its output with the stored K/V through the round trip.
FORMATS: dict[str, Callable] = {
    "e4m3 K and V": lambda forward, module, q, k, v: forward(module, q, e4m3(k), e4m3(v)),
    "e4m3 K only": lambda forward, module, q, k, v: forward(module, q, e4m3(k), v),
    "e4m3 V only": lambda forward, module, q, k, v: forward(module, q, k, e4m3(v)),
    f"e4m3, first {SINKS} entries exact": _sinks_exact,
    "e4m3 after a Hadamard rotation": _rotated,
    "int8 K and V": lambda forward, module, q, k, v: forward(module, q, int8(k), int8(v)),
    "bfloat16 K and V": lambda forward, module, q, k, v: forward(module, q, k.bfloat16().to(k.dtype),
                                                                 v.bfloat16().to(v.dtype)),
}


def emulated(forward: Forward, name: str) -> Forward:
    """PagedAttention.forward with the stored keys and values passed through format `name`'s round trip."""
    emulate = FORMATS[name]
    return lambda module, query, key, value: emulate(forward, module, query, key, value)


def main(argv: list[str] | None = None) -> None:
    parser = common_parser(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    model, shape, tokenizer, prompts, dtype = load(parser, args)
    longest = max(len(prompt) for prompt in prompts) + args.new_tokens
    config = ZipageConfig(block_size=BLOCK_SIZE, compress=False, prefix_cache=False, async_compress=False)

    def engine():
        return build_engine(model, shape, tokenizer, args.gguf, config, len(prompts), longest, dtype, args.device)

    reference = generate_reference(engine(), prompts, args.new_tokens, 0.7, args.seed)
    print(f"reference: {len(prompts)} prompts x {args.new_tokens} tokens, {args.dtype} on {args.device}", flush=True)
    original = layers.PagedAttention.forward
    lines = ["| stored K/V (emulated, Full KV) | agreement | disagreement | per prompt (pt) | KL (nats) |",
             "|---|---:|---:|---|---:|"]
    try:
        for name in FORMATS:
            layers.PagedAttention.forward = emulated(original, name)
            started = time.perf_counter()
            agree, kl, _ = force(engine(), reference, [None])[None]
            per_prompt = ", ".join(f"{(1 - value) * 100:.1f}" for value in agree.double().mean(dim=1))
            lines.append(f"| {name} | {agree.double().mean():.4f} | {(1 - agree.double().mean()) * 100:.2f} pt | "
                         f"{per_prompt} | {kl.mean():.5f} |")
            print(f"{lines[-1]}  ({time.perf_counter() - started:.0f} s)", flush=True)
    finally:
        layers.PagedAttention.forward = original
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
