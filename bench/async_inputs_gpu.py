"""Async scheduling with a step's host inputs copied through pinned memory, against pageable copies
(docs/BENCHMARKS.md, 'Async scheduling'): a copy from pageable memory waits for the stream's earlier
work, so under async scheduling an eager prefill or mixed step (its input columns) and every step
that samples at a temperature (the sampler's per-row settings) waited for the step still running
before it was launched, and that step settled only after. One engine, one process, on a trace
whose requests arrive while others decode (a mixed step each), greedy and sampled:

    . bench/env.sh && python bench/async_inputs_gpu.py --trace traces/chat.json --requests 80

"pageable" is the engine before the change (`ModelRunner.pinned_inputs` off, the sampler's
`on_device` replaced by `torch.tensor(values, device=...)`); the table prints tok/s, TTFT and TPOT
percentiles, and the mean recorded duration of mixed and decode steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import zipage.engine.sampler as sampler
from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings, effective_config, trace_sequences
from zipage.core.sampling import SamplingParams
from zipage.engine.builder import build_engine
from zipage.engine.loop import EngineLoop
from zipage.trace import Trace, load_trace

PINNED_ON_DEVICE = sampler.on_device


def pageable_on_device(values, device):
    return torch.tensor(values, device=device)


def run(engine, trace, settings, sampling, asynchronous: bool, pinned: bool) -> dict:
    engine.runner.pinned_inputs = pinned and asynchronous and engine.device.type == "cuda"
    sampler.on_device = PINNED_ON_DEVICE if pinned else pageable_on_device
    config = effective_config(settings, engine.shape)
    config = ZipageConfig.from_dict({**config.to_dict(), "async_scheduling": asynchronous})
    scheduler = engine.new_scheduler(config)
    sequences = trace_sequences(trace, engine.shape.vocab_size, need_tokens=True,
                                scheduler=scheduler)
    for seq in sequences:
        seq.sampling = sampling
    started = time.perf_counter()
    result = EngineLoop(scheduler, engine.runner).run(sequences)
    wall = time.perf_counter() - started
    summary = result.summary
    by_kind: dict[str, list[float]] = {}
    for step in result.steps:
        by_kind.setdefault(step.kind, []).append((step.t_end - step.t_start) * 1e3)
    return {"tok/s": summary["tps"], "ttft p50 ms": summary["ttft_p50_s"] * 1e3,
            "ttft p90 ms": summary["ttft_p90_s"] * 1e3, "tpot p50 ms": summary["tpot_p50_ms"],
            "mixed ms": statistics.fmean(by_kind.get("mixed", [0.0])),
            "decode ms": statistics.fmean(by_kind.get("decode", [0.0])),
            "steps": len(result.steps), "wall s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:qwen3-8b")
    parser.add_argument("--trace", default="traces/chat.json")
    parser.add_argument("--requests", type=int, default=80)
    parser.add_argument("--kv-memory-gb", type=float, default=6.0)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--device", default="cuda", help="cpu: check the script, time nothing")
    args = parser.parse_args()
    trace = load_trace(args.trace)
    trace = Trace(trace.name, trace.requests[:args.requests])
    config = ZipageConfig(block_size=64, kv_budget=512, async_scheduling=True)
    settings = ReplaySettings(model=args.model, kv_memory_gb=args.kv_memory_gb, config=config)
    engine = build_engine(settings, args.device)
    variants = [("sync", False, True), ("async pageable", True, False),
                ("async pinned", True, True)]
    samplings = {"greedy": SamplingParams(temperature=0.0, ignore_eos=True),
                 "t=0.8": SamplingParams(temperature=0.8, top_p=0.95, ignore_eos=True)}
    rows = []
    for _ in range(args.repeat):
        for sampling_name, sampling in samplings.items():
            for name, asynchronous, pinned in variants:
                row = run(engine, trace, settings, sampling, asynchronous, pinned)
                rows.append((sampling_name, name, row))
                print(sampling_name, name, {k: round(v, 2) for k, v in row.items()}, flush=True)
    columns = list(rows[0][2])
    print(f"\n{trace.name}, first {len(trace.requests)} requests, {args.model}, "
          f"{torch.cuda.get_device_name() if args.device == 'cuda' else args.device}")
    print(f"{'sampling':9} {'variant':15} " + " ".join(f"{c:>11}" for c in columns))
    for sampling_name, name, row in rows:
        print(f"{sampling_name:9} {name:15} " + " ".join(f"{row[c]:>11.2f}" for c in columns))


if __name__ == "__main__":
    main()
