"""The paged prefill attention kernel at the shapes of Qwen3-0.6B and Qwen3-8B, against torch's
flash attention (run on a GPU; results go to docs/BENCHMARKS.md, 'Prefill').

One prompt of 128 / 512 / 2k / 8k tokens, block 64, bfloat16: the Triton kernel with each launch
configuration of `--configs` (rows per program, KV tile, warps, pipeline stages; the first is the
shipped default); the same prompt through the work list of a CUDA graph's padded step (sized
for as many rows in up to 512 sequences, mostly padding) walked by 1-4 programs per SM or one
program per item; and torch's dense causal scaled_dot_product_attention on the same shapes (KV
repeated per query head, so the flash backend takes it) as what the hardware can do. Time is
triton.testing.do_bench's median; TFLOP/s counts the causal half of QK^T and PV.

    . bench/env.sh && python bench/prefill_attention_gpu.py [--tokens 512,2048,8192]

`--cached C` times a chunk instead: the `--tokens` new tokens of a prompt whose first C are already
cached (as chunked prefill runs a long prompt's later chunks), each new token attending to the C
cached entries and the new ones before it; TFLOP/s then counts those pairs, and torch's flash
attention gets the same C + tokens keys with the causal mask aligned to their end:

    python bench/prefill_attention_gpu.py --models qwen3-8b --tokens 2048 --cached 0,4096,8192,16384 --configs 64/64/4/3

`--kv-cache-dtype fp8` reads a float8 cache with its per-entry scales (random entries quantized as the
engine stores them) and compares with the reference in bfloat16, and times a second way to read it (the
sequence's blocks widened to a bfloat16 scratch by torch, then the bfloat16 kernel); the variants
`queries`+`weights` and `f16keys`+`f16asmvalues` are the prefill's ways of widening FP8 keys and values
(`_PREFILL_FP8_KEYS`, `_PREFILL_FP8_VALUES`):

    python bench/prefill_attention_gpu.py --models qwen3-8b --tokens 2048 --cached 0,8192,16384 \
        --configs 64/64/4/3 --kv-cache-dtype fp8 --variants queries+weights,f16keys+f16asmvalues

`--variants` adds the kernel's launch-time variants (attention_triton's `_PREFILL_KV_LOAD`,
`_PREFILL_SPLIT_CAUSAL`, `_PREFILL_FOLD_SCALE`; names in VARIANTS, joined by '+'): each is timed at
every config, and its output compared with the default kernel's at the first config ('!' past 2e-2):

    python bench/prefill_attention_gpu.py --tokens 512,2048,8192 --configs 64/64/4/3,128/64/4/3 \
        --variants default,gather+nosplit+nofold,block+nosplit+nofold,descriptor+nosplit+nofold,descriptor+split+nofold

(the shipped kernel is descriptor+split+fold; gather+nosplit+nofold is the kernel without the load, split and fold
choices, the baseline they are measured against).

Prints a table last and writes prefill_attention_gpu.json under $OUT (or runs/<script>/ of the repository).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import triton.testing
from check_attention_gpu import random_paged_cache, with_settings  # noqa: E402 (bench/ is the script's path)

from zipage.kernels.attention import prefill_tile_tokens, prefill_work, prefill_work_capacity
from zipage.kernels.attention_ref import paged_prefill_attention_ref
from zipage.kernels.attention_triton import paged_prefill_attention_triton

# (query heads, KV heads, head_dim) of the models whose prefill steps bench/prefill_gpu.py times.
SHAPES = {"qwen3-0.6b": (16, 8, 128), "qwen3-8b": (32, 8, 128)}
SETTINGS = ("_PREFILL_ROWS", "_KV_TILE", "_PREFILL_NUM_WARPS", "_PREFILL_NUM_STAGES")
# An FP8 cache's launch takes its own tile and stages.
FP8_SETTINGS = ("_PREFILL_ROWS", "_PREFILL_FP8_KV_TILE", "_PREFILL_NUM_WARPS", "_PREFILL_FP8_NUM_STAGES")
CONFIGS = "64/64/4/3,64/64/4/2,128/64/8/2,128/64/8/3,128/64/4/3,64/128/4/2,128/128/8/2"
# Variant parts (`--variants`, '+'-joined; "default" alone is the shipped kernel): the knobs each one sets.
VARIANTS = {
    "default": {},
    # one block-table entry per token and an offset tensor built from them
    "gather": {"_PREFILL_KV_LOAD": "gather"},
    # one block id per KV tile, offsets as a scalar base + arange (block size a multiple of the tile)
    "block": {"_PREFILL_KV_LOAD": "block"},
    # the K/V tiles through TMA tensor descriptors of the whole cache (Hopper's bulk tensor copies)
    "descriptor": {"_PREFILL_KV_LOAD": "descriptor"},
    # tiles every row sees whole run unmasked; only the diagonal tiles apply the causal and token masks
    "split": {"_PREFILL_SPLIT_CAUSAL": True},
    "nosplit": {"_PREFILL_SPLIT_CAUSAL": False},
    # scale * log2(e) inside exp2's argument (one FMA) instead of scaling the logits
    "fold": {"_PREFILL_FOLD_SCALE": True},
    "nofold": {"_PREFILL_FOLD_SCALE": False},
    # with an FP8 cache: keys widened to the queries' dtype, or the queries narrowed to float16 and the keys widened
    # to it; values widened after shared memory ("weights") or by inline assembly before it
    "queries": {"_PREFILL_FP8_KEYS": "queries"},
    "f16keys": {"_PREFILL_FP8_KEYS": "f16"},
    "f16asmkeys": {"_PREFILL_FP8_KEYS": "f16-asm"},
    "weights": {"_PREFILL_FP8_VALUES": "weights"},
    "f16values": {"_PREFILL_FP8_VALUES": "f16"},
    "f16asmvalues": {"_PREFILL_FP8_VALUES": "f16-asm"},
}
BLOCK_SIZE = 64
# The padded step of a CUDA graph: a work list sized for `tokens` rows in up to this many sequences.
GRAPH_SEQUENCES = 512
# Work-list walks timed: programs per SM (a huge count gives one program per item, the baseline).
PROGRAMS_PER_SM = (1, 2, 3, 4, 1 << 20)


def milliseconds(function) -> float:
    return triton.testing.do_bench(function, warmup=10, rep=100, return_mode="median")


def variant_settings(variant: str) -> tuple[tuple, tuple]:
    """The (names, values) of a '+'-joined variant, for with_settings; unknown parts raise KeyError."""
    settings: dict = {}
    for part in variant.split("+"):
        settings.update(VARIANTS[part])
    return tuple(settings), tuple(settings.values())


def measure(model: str, tokens: int, configs: list[tuple[int, ...]], variants: list[str],
            cached: int = 0, fp8: bool = False) -> dict:
    heads, kv_heads, head_dim = SHAPES[model]
    context = cached + tokens
    generator = torch.Generator(device="cuda").manual_seed(tokens)
    scales = {}
    if fp8:
        from fp8_gpu import HEAD_DIM, KV_HEADS, _paged

        assert (kv_heads, head_dim) == (KV_HEADS, HEAD_DIM), "fp8_gpu's paged cache has 8 KV heads of 128"
        k_cache, v_cache, k_scale, v_scale, tables = _paged([context], BLOCK_SIZE, generator, "cuda")
        scales = dict(k_scale=k_scale, v_scale=v_scale)
    else:
        k_cache, v_cache, tables = random_paged_cache([context], BLOCK_SIZE, kv_heads, head_dim, generator)
    q = torch.randn((tokens, heads, head_dim), generator=generator, device="cuda").to(torch.bfloat16)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    lens = torch.tensor([context], dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5

    def paged():
        return paged_prefill_attention_triton(q, k_cache, v_cache, cu, lens, tables, scale, max_q_len=tokens,
                                              **scales)

    flops = 2 * 2 * heads * head_dim * (tokens * cached + tokens * (tokens + 1) / 2)
    # The default kernel's output, or with an FP8 cache the reference's (the variants differ in how they widen it).
    reference = paged_prefill_attention_ref(q, k_cache, v_cache, cu, lens, tables, scale, **scales) if fp8 else paged()
    row = {"model": model, "tokens": tokens, "cached": cached, "kv_cache_dtype": "fp8" if fp8 else "auto",
           "flops": flops, "configs": []}
    for variant in variants:
        for config in configs:
            entry = {"config": "/".join(map(str, config)), "variant": variant}
            try:
                names, values = variant_settings(variant)
                names, values = (FP8_SETTINGS if fp8 else SETTINGS) + names, tuple(config) + values
                out = with_settings(names, values, paged)
                entry["max_abs_difference"] = (out.float() - reference.float()).abs().max().item()
                entry["ms"] = with_settings(names, values, lambda: milliseconds(paged))
            except Exception as error:  # noqa: BLE001 - a variant or config that does not compile is a result
                entry["error"] = repr(error)[:200]
            row["configs"].append(entry)
    if fp8:
        dequantized(row, q, k_cache, v_cache, scales, cu, lens, tables, scale, reference, tokens, configs[0])
    if cached == 0 and not fp8:
        # The work list of a CUDA graph's padded step (whole bfloat16 prompts only).
        work_list(row, q, k_cache, v_cache, cu, lens, tables, scale, reference, tokens, heads, kv_heads)
    # Torch's flash attention on the same keys: the mask's diagonal aligned to the keys' end (the
    # new tokens are the last `tokens` of `context`), as the paged kernel's.
    dense_q = q.transpose(0, 1)[None]
    dense_k = torch.randn((1, heads, context, head_dim), generator=generator, device="cuda").to(torch.bfloat16)
    if cached == 0:
        row["sdpa_ms"] = milliseconds(lambda: torch.nn.functional.scaled_dot_product_attention(
            dense_q, dense_k, dense_k, is_causal=True, scale=scale))
    else:
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(tokens, context)
        row["sdpa_ms"] = milliseconds(lambda: torch.nn.functional.scaled_dot_product_attention(
            dense_q, dense_k, dense_k, attn_mask=mask, scale=scale))
    return row


def dequantized(row, q, k_cache, v_cache, scales, cu, lens, tables, scale, reference, tokens, config) -> None:
    """An FP8 cache read another way: the sequence's blocks gathered and widened to bfloat16 in a scratch cache
    (torch ops), then the bfloat16 kernel over it with a table of the scratch's own blocks; timed together and
    the widening alone (at the first config)."""
    from zipage.kernels.kv_quant_ref import dequantize_kv

    used = tables[0][tables[0] >= 0].long()
    scratch_table = torch.arange(used.numel(), dtype=torch.int32, device="cuda")[None]

    def widen():
        keys = dequantize_kv(k_cache[used], scales["k_scale"][used]).to(torch.bfloat16)
        values = dequantize_kv(v_cache[used], scales["v_scale"][used]).to(torch.bfloat16)
        return keys, values

    def widened():
        keys, values = widen()
        return paged_prefill_attention_triton(q, keys, values, cu, lens, scratch_table, scale, max_q_len=tokens)

    out = with_settings(SETTINGS, tuple(config), widened)
    row["dequantized"] = {"config": "/".join(map(str, config)),
                          "max_abs_difference": (out.float() - reference.float()).abs().max().item(),
                          "ms": with_settings(SETTINGS, tuple(config), lambda: milliseconds(widened)),
                          "widen_ms": milliseconds(widen)}


def work_list(row, q, k_cache, v_cache, cu, lens, tables, scale, reference, tokens, heads, kv_heads) -> None:
    """The prompt through the work list of a CUDA graph's padded step: this prompt, then empty
    sequences and padding items, walked by 1-4 programs per SM or one program per item."""
    seqs = min(tokens, GRAPH_SEQUENCES)
    tile = prefill_tile_tokens(heads, kv_heads)
    padded_cu = torch.cat((cu, cu[-1:].expand(seqs - 1)))
    padded_lens = torch.cat((lens, torch.zeros(seqs - 1, dtype=torch.int32, device="cuda")))
    padded_tables = torch.cat((tables, tables[:1].expand(seqs - 1, -1)))
    host_work = prefill_work((padded_cu[1:] - padded_cu[:-1]).long().cpu(), tile,
                             prefill_work_capacity(tokens, seqs, tile))
    work = type(host_work)(host_work.items.cuda(), tile)

    def walked():
        return paged_prefill_attention_triton(q, k_cache, v_cache, padded_cu, padded_lens, padded_tables,
                                              scale, work=work)

    row["work_items"] = int(work.items.shape[0])
    row["work_list"] = []
    for per_sm in PROGRAMS_PER_SM:
        entry = {"programs_per_sm": per_sm}
        out = with_settings(("_PREFILL_PROGRAMS_PER_SM",), (per_sm,), walked)
        entry["max_abs_difference"] = (out.float() - reference.float()).abs().max().item()
        entry["ms"] = with_settings(("_PREFILL_PROGRAMS_PER_SM",), (per_sm,), lambda: milliseconds(walked))
        row["work_list"].append(entry)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=",".join(SHAPES))
    parser.add_argument("--tokens", default="128,512,2048,8192")
    parser.add_argument("--configs", default=CONFIGS,
                        help="rows/tile/warps/stages, comma separated; the first is the baseline")
    parser.add_argument("--variants", default="default",
                        help=f"kernel variants, comma separated, each '+'-joined parts of {', '.join(VARIANTS)}; "
                             "every variant is timed at every config; outputs are compared with the default kernel")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="fp8: a float8 cache with per-entry scales, checked against the reference")
    parser.add_argument("--cached", default="0",
                        help="cached tokens before the new ones, comma separated (default 0: whole prompts)")
    args = parser.parse_args()
    configs = [tuple(int(v) for v in c.split("/")) for c in args.configs.split(",")]
    variants = args.variants.split(",")
    for variant in variants:
        variant_settings(variant)  # an unknown name fails here, before any GPU work
    rows = [measure(model, int(tokens), configs, variants, int(cached), args.kv_cache_dtype == "fp8")
            for model in args.models.split(",") for tokens in args.tokens.split(",")
            for cached in args.cached.split(",")]
    # $OUT when set (the GPU harness collects it), else the ignored runs/ of the repository.
    out = Path(os.environ.get("OUT")
               or Path(__file__).resolve().parents[1] / "runs" / "prefill_attention_gpu")
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill_attention_gpu.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "rows": rows}, indent=2))
    print(f"\n{torch.cuda.get_device_name()}: ms (TFLOP/s) per rows/tile/warps/stages; sdpa = torch flash; "
          "'!' = output differs from the default kernel's by more than 2e-2")
    for variant in variants:
        entries = [e for e in rows[0]["configs"] if e["variant"] == variant]
        print(f"\nvariant {variant}")
        print(f"{'model':<11} {'tokens':>6} {'cached':>6} " + " ".join(f"{e['config']:>16}" for e in entries)
              + f" {'sdpa':>16}")
        for row in rows:
            cells = []
            for entry in (e for e in row["configs"] if e["variant"] == variant):
                if "ms" not in entry:
                    cells.append(f"{'error':>16}")
                else:
                    bad = "!" if entry["max_abs_difference"] > 2e-2 else ""
                    cells.append(f"{entry['ms']:>7.3f} ({row['flops'] / entry['ms'] / 1e9:>4.0f}){bad:1}")
            cells.append(f"{row['sdpa_ms']:>7.3f} ({row['flops'] / row['sdpa_ms'] / 1e9:>4.0f}) ")
            print(f"{row['model']:<11} {row['tokens']:>6} {row['cached']:>6} " + " ".join(cells))
    errors = {(e["variant"], e["config"]): e["error"] for row in rows for e in row["configs"] if "error" in e}
    for (variant, config), error in errors.items():
        print(f"error: variant {variant} at {config}: {error}")
    for row in (row for row in rows if "dequantized" in row):
        entry = row["dequantized"]
        print(f"dequantized to bfloat16 first ({entry['config']}): {row['model']} {row['tokens']} tokens, "
              f"{row['cached']} cached: {entry['ms']:.3f} ms ({row['flops'] / entry['ms'] / 1e9:.0f}), of it "
              f"widening {entry['widen_ms']:.3f} ms; max |difference| {entry['max_abs_difference']:.3g}")
    print(f"\nwork list of a padded step ({GRAPH_SEQUENCES} sequences at most): ms per programs/SM "
          f"({', '.join(map(str, PROGRAMS_PER_SM[:-1]))}, one per item); grid: the first config above")
    for row in (row for row in rows if "work_list" in row):
        cells = [f"{e['ms']:>7.3f}{'!' if e['max_abs_difference'] > 2e-2 else ' '}" for e in row["work_list"]]
        print(f"{row['model']:<11} {row['tokens']:>6} {row['work_items']:>5} items " + " ".join(cells)
              + f"  grid {row['configs'][0].get('ms', float('nan')):>7.3f}")


if __name__ == "__main__":
    main()
