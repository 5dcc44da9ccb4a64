"""GPU check of the engine's decode paths: CUDA-graph replay vs eager, with and without compression.

The graph path stages only the block-table columns a batch uses and runs on the runner's
high-priority stream while async compressions run beside it; the eager path builds its inputs
directly. Both run the same kernels, but the graph path runs the padded bucket size, whose split-K
layout (and so the order of the float sums) differs, and an async batch's completion step depends
on timing; so a few requests may diverge late, hence an agreement threshold, not equality. Random
`random:qwen3-0.6b` weights in float32 (so near-ties in bfloat16 cannot flip a greedy choice),
a small AMC23-shaped trace, EOS ignored. Prints the share of requests whose outputs agree exactly
and the first token index where the others diverge; exits 1 below `--min-agreement`.

    python bench/check_engine_gpu.py
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch

from zipage.core.config import ZipageConfig
from zipage.engine.replay import replay_on_engine
from zipage.deployment import ReplaySettings
from zipage.workloads import make_trace


def run(trace, config: ZipageConfig, cuda_graphs: bool, model: str) -> dict[str, list[int]]:
    settings = ReplaySettings(model=f"random:{model}", dtype="float32", kv_memory_gb=1.0,
                              config=config)
    _, engine_run = replay_on_engine(trace, settings, "cuda", cuda_graphs=cuda_graphs)
    gc.collect()
    torch.cuda.empty_cache()
    return engine_run.tokens


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--min-agreement", type=float, default=0.9)
    args = parser.parse_args()
    out = Path(os.environ.get("OUT", "."))
    trace = make_trace("amc23", 0, num_questions=4, samples_per_question=8, max_output_len=600)
    variants = {
        "full-kv": ZipageConfig(compress=False, block_size=64),
        "zipage async": ZipageConfig(block_size=64, kv_budget=256),
        "zipage sync": ZipageConfig(block_size=64, kv_budget=256, async_compress=False),
    }
    report, failed = {}, False
    for name, config in variants.items():
        torch.manual_seed(0)
        graphs = run(trace, config, True, args.model)
        torch.manual_seed(0)
        eager = run(trace, config, False, args.model)
        same = [seq_id for seq_id in graphs if graphs[seq_id] == eager[seq_id]]
        diverged = sorted(next(i for i, (a, b) in enumerate(zip(graphs[s], eager[s])) if a != b)
                          for s in graphs if s not in same)
        agreement = len(same) / len(graphs)
        failed |= agreement < args.min_agreement
        report[name] = dict(agreement=agreement, first_divergence=diverged[:8])
        print(f"{name:<14} graphs == eager for {len(same)}/{len(graphs)} requests; "
              f"divergence at token {diverged[:8]}", flush=True)
    (out / "check_engine_gpu.json").write_text(json.dumps(report, indent=2))
    print(f"RESULT: {'FAIL' if failed else 'PASS'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
