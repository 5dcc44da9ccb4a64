"""GPU check of async scheduling (docs/architecture.md, 'Async scheduling'): the same greedy
requests through one engine, synchronous and async, must give the same tokens (decode graphs,
padded prefill graphs and compression on); prints the tokens that differ and each mode's wall
time. Timing variants are bench/peer_tables.py's `--async-scheduling`.

    python bench/async_gpu.py --model qwen3-0.6b --requests 96 --output 96
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings
from zipage.core.sampling import SamplingParams
from zipage.core.sequence import Sequence
from zipage.engine.builder import build_engine
from zipage.engine.loop import EngineLoop


def requests(count: int, output: int, vocab: int) -> list[Sequence]:
    generator = torch.Generator().manual_seed(7)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    sequences = []
    for index in range(count):
        length = int(torch.randint(16, 400, (1,), generator=generator))
        prompt = torch.randint(0, vocab, (length,), generator=generator).tolist()
        seq = Sequence(f"r{index}", arrival_s=0.0, prompt_len=length, max_output_tokens=output,
                       prompt_token_ids=prompt)
        seq.sampling = greedy
        sequences.append(seq)
    return sequences


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--output", type=int, default=96)
    parser.add_argument("--kv-memory-gb", type=float, default=0.5, help="small: compressions and preemptions")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script")
    args = parser.parse_args()
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    failed = False
    # Decisions that do not depend on when an async compression batch ends on the device (those
    # move with timing in either mode), so the tokens must match exactly.
    for name, knobs in (("full-kv", dict(compress=False)), ("sync-compress", dict(async_compress=False))):
        config = ZipageConfig(block_size=64, kv_budget=256, window=8, **knobs)
        settings = ReplaySettings(model=f"random:{args.model}", hardware="h200",
                                  kv_memory_gb=args.kv_memory_gb, config=config)
        engine = build_engine(settings, args.device)
        tokens, walls, summaries = {}, {}, {}
        for mode in (False, True, False, True):
            scheduler = engine.new_scheduler(dataclasses.replace(config, async_scheduling=mode))
            loop = EngineLoop(scheduler, engine.runner)
            started = time.perf_counter()
            run = loop.run(requests(args.requests, args.output, engine.shape.vocab_size))
            walls.setdefault(mode, []).append(time.perf_counter() - started)
            tokens.setdefault(mode, run.tokens)
            summaries[mode] = run.summary
        differ = [seq_id for seq_id in tokens[False] if tokens[False][seq_id] != tokens[True].get(seq_id)]
        failed |= bool(differ)
        print(f"{name}, async scheduling on {device}: {args.requests} requests, "
              f"{len(differ)} with other tokens than synchronous {differ[:5]}")
        for mode in (False, True):
            summary = summaries[mode]
            print(f"  {'async' if mode else 'sync '}: wall {' / '.join(f'{w:.2f}' for w in walls[mode])} s, "
                  f"compressions {summary.get('compressions')}, preemptions {summary.get('preemptions')}")
        del engine
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
