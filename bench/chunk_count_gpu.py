"""What a prompt chunk costs when a step holds many (issue #49: the headline's TTFT p50 is priced
~80 % high by the 8B Zipage profile, whose fitting runs hold steps of 1-8 chunks only).

One engine per mode (zipage, fullkv; random Qwen3-8B, 6 GB of KV, blocks of 64, budget 512: the
shipped profiles' settings), then, through `run_on_engine`, small traces built so one step holds
N prompt chunks:

- prefill sweep: N requests of T/N prompt tokens at time 0 (T = 512 and 2048; N = 1 ... 128), two
  output tokens: the first step is a pure prefill of N chunks;
- mixed sweep: 64 requests decoding (prompt 96, output 600) and, 0.5 s later, N requests of 2048/N
  prompt tokens: their first step is a mixed step of N chunks beside ~64 decode rows;
- the headline trace (traces/amc23-headline.json) once, Zipage only (its first steps hold 39-51
  chunks; Full KV's run takes ~195 s).

Each sweep trace runs `--repeats` times (the first as warm-up is kept too: the table takes the
median). Every step of every run goes to chunk_count.json under $OUT (or runs/chunk_count/), to be
priced offline with any profile; the table printed last is the measured step of interest.

    . bench/env.sh && python bench/chunk_count_gpu.py
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch

from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings
from zipage.engine.builder import build_engine
from zipage.engine.replay import run_on_engine
from zipage.trace import Trace, TraceRequest, load_trace

ROOT = Path(__file__).resolve().parent.parent
HEADLINE = ROOT / "traces" / "amc23-headline.json"
MODES = {"zipage": {}, "fullkv": {"compress": False}}
COUNTS = (1, 2, 4, 8, 16, 32, 64, 128)
DECODERS, MIXED_AT_S = 64, 0.5


def prefill_trace(count: int, tokens: int) -> Trace:
    return Trace(f"prefill-{count}x{tokens // count}", [
        TraceRequest(f"p{i}", 0.0, tokens // count, 2) for i in range(count)])


def mixed_trace(count: int, tokens: int, decode_len: int) -> Trace:
    decoders = [TraceRequest(f"d{i}", 0.0, 96, decode_len) for i in range(DECODERS)]
    return Trace(f"mixed-{count}x{tokens // count}", decoders + [
        TraceRequest(f"p{i}", MIXED_AT_S, tokens // count, 2) for i in range(count)])


def step_of_interest(steps: list[dict], mixed: bool) -> dict | None:
    """The first step holding the most chunks (for a mixed trace: of the late requests, beside
    decode rows): the scheduler may split N prompts over steps (the step's token limit, Zipage's
    query slots)."""
    candidates = [step for step in steps if step["n_prefill"] and (
        not mixed or (step["n_decode"] and step["t_start"] >= MIXED_AT_S))]
    return max(candidates, key=lambda step: step["n_prefill"], default=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="zipage,fullkv")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-headline", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="random:qwen3-8b")
    parser.add_argument("--kv-memory-gb", type=float, default=6.0)
    parser.add_argument("--counts", default=",".join(map(str, COUNTS)))
    parser.add_argument("--decode-len", type=int, default=600,
                        help="output tokens of the mixed sweep's 64 decoding requests")
    args = parser.parse_args()
    out = Path(os.environ.get("OUT") or ROOT / "runs" / "chunk_count")
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"runs": []}
    table = []
    for mode in args.modes.split(","):
        config = ZipageConfig(block_size=64, kv_budget=512, **MODES[mode])
        settings = ReplaySettings(model=args.model, hardware="h200-141gb",
                                  kv_memory_gb=args.kv_memory_gb, config=config)
        started = time.perf_counter()
        engine = build_engine(settings, args.device)
        report[f"build_{mode}_s"] = time.perf_counter() - started
        counts = [int(n) for n in args.counts.split(",")]
        cases = [("prefill", n, t) for t in (512, 2048) for n in counts if t // n >= 4]
        cases += [("mixed", n, 2048) for n in counts]
        for sweep, count, tokens in cases:
            trace = (prefill_trace(count, tokens) if sweep == "prefill"
                     else mixed_trace(count, tokens, args.decode_len))
            measured, held = [], set()
            for repeat in range(args.repeats):
                _, run = run_on_engine(engine, trace, settings)
                steps = [dataclasses.asdict(step) for step in run.steps]
                report["runs"].append({"mode": mode, "trace": trace.name, "repeat": repeat,
                                       "steps": steps})
                step = step_of_interest(steps, sweep == "mixed")
                if step is not None:
                    measured.append((step["t_end"] - step["t_start"]) * 1e3)
                    held.add((step["n_prefill"], step["n_decode"], step["prefill_tokens"]))
            row = {"mode": mode, "sweep": sweep, "chunks": count, "tokens": tokens,
                   "held": sorted(held),
                   "ms": statistics.median(measured) if measured else None,
                   "spread_ms": (max(measured) - min(measured)) if measured else None}
            table.append(row)
            print(json.dumps(row), flush=True)
        if mode == "zipage" and not args.no_headline:
            summary, run = run_on_engine(engine, load_trace(HEADLINE), settings)
            report["headline"] = {"summary": {key: summary.get(key) for key in
                                              ("makespan_s", "ttft_p50_s", "ttft_p90_s",
                                               "tpot_p50_ms")},
                                  "steps": [dataclasses.asdict(step) for step in run.steps[:40]]}
            print("headline", json.dumps(report["headline"]["summary"]), flush=True)
        (out / "chunk_count.json").write_text(json.dumps(report))
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    report["table"] = table
    (out / "chunk_count.json").write_text(json.dumps(report))
    print(f"\n{'mode':<7} {'sweep':<8} {'chunks':>6} {'tokens':>6} {'step ms':>8} {'spread':>7}  "
          "held (chunks, decodes, tokens)")
    for row in table:
        ms = "-" if row["ms"] is None else f"{row['ms']:.2f}"
        spread = "-" if row["spread_ms"] is None else f"{row['spread_ms']:.2f}"
        print(f"{row['mode']:<7} {row['sweep']:<8} {row['chunks']:>6} {row['tokens']:>6} {ms:>8} "
              f"{spread:>7}  {row['held']}")
    if "headline" in report:
        for step in report["headline"]["steps"][:4]:
            print("headline step", step["step_id"], step["kind"], step["n_prefill"], step["n_decode"],
                  step["prefill_tokens"], f"{(step['t_end'] - step['t_start']) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
