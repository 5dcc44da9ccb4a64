"""Prefill steps against the roofline (run on a GPU; results go to docs/BENCHMARKS.md).

For random Qwen3 weights (0.6B and 8B by default) and one request of 128 / 512 / 2k / 8k prompt
tokens, time one whole prefill step as the step loop sees it (`ModelRunner.execute`: inputs on
the host, the forward, the logits, sampling, the token back on the host), the GPU's own time for
the same step (CUDA events around it: kernels plus the gaps the host leaves), the kernel time
alone and the number of kernel launches (torch.profiler, one profiled step), and the roofline:

    max(weight bytes / copy bandwidth, (2 x params x tokens + attention FLOPs) / matmul FLOP/s)

with the copy bandwidth and the bf16 matmul rate measured on this GPU in the same run. A step far
above its kernel time is host-bound (launch and Python overhead); a kernel time far above the
roofline is the kernels'.

    . bench/env.sh && python bench/prefill_gpu.py [--models qwen3-0.6b,qwen3-8b] [--tokens 128,512,2048,8192]
        [--prefill-graphs off,on,folded,sectioned|both] [--decodes N --decode-context C,...] [--cached 0,8192,...]
        [--block-size 64]

`--prefill-graphs both` (the default, = `off,on`) times every step eagerly, then with the runner's
padded prefill graphs (`ModelRunner.enable_prefill_graphs`: one CUDA graph per token bucket up to
4096, eager above), on the same engine, one row each. Graphed mixed steps take the decode section
by the engine's rule (zipage/prefill_buckets.py, `takes_decode_section`); `folded` never takes it
(every decode row a sequence of the prefill launch, the engine before the section) and `sectioned`
always does where the rows fit it, to compare the two on either side of the rule
(bench/check_engine_gpu.py checks what the section computes). `--decodes N` makes every step a
mixed one: the prompt plus N requests decoding one token each over C cached entries (chunked
prefill's shape).
`--cached` makes each prompt a later chunk: its tokens attend to that many entries of the same
prompt already in the cache (a long prompt's tenth 2,048-token chunk sits over ~18k).

Prints a table last and writes prefill_gpu.json under $OUT (or runs/<script>/ of the repository).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import time
from pathlib import Path

import torch
from engine_gpu import copy_bandwidth, weight_bytes_read  # noqa: E402 (bench/ is the script's path)
from replay_variant import RULES  # noqa: E402

from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings
from zipage.core.memory import kv_token_bytes
from zipage.core.sampling import SamplingParams
from zipage.core.sequence import Sequence
from zipage.core.step import MIXED, PREFILL, PrefillItem, StepPlan, causal_pairs
from zipage.engine import runner as runner_module
from zipage.engine.builder import build_engine
from zipage.presets import get_preset

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
# The graphed modes by the decode section's rule they run with.
SECTION_RULES = {"on": RULES["rule"], "folded": RULES["never"], "sectioned": RULES["always"]}


def matmul_flops() -> float:
    """bf16 FLOP/s of a large square matmul on this GPU (random data)."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192**3 * 10 / (time.perf_counter() - started)


def roofline(model: str, tokens: int, bandwidth: float, flops: float, cached: int = 0) -> float:
    shape = get_preset(model)
    # Matmul FLOPs of every weight but the input embedding (a gather), for every token; the LM
    # head only for the one sampled token. Attention: QK^T and PV over the causal half.
    embedding = shape.vocab_size * shape.hidden_size
    body = shape.num_params - embedding - (0 if shape.tie_embeddings else embedding)
    linear = 2 * body * tokens + 2 * embedding
    attention = 2 * 2 * shape.num_layers * shape.num_heads * shape.head_dim * causal_pairs(tokens, cached)
    return max(weight_bytes_read(model) / bandwidth, (linear + attention) / flops)


def measure(model: str, token_counts: list[int], repeats: int, bandwidth: float,
            flops: float, graphs: tuple[str, ...], decodes: int, decode_contexts: tuple[int, ...],
            cached_counts: tuple[int, ...] = (0,), block_size: int = 64) -> list[dict]:
    longest = max(token_counts)
    shape = get_preset(model)
    entries = longest + max(cached_counts) + 1024 + decodes * (max(decode_contexts) + 2 * block_size)
    kv_gb = entries * kv_token_bytes(shape, "auto", 2) / 2**30
    settings = ReplaySettings(model=f"random:{model}", dtype="bfloat16", kv_memory_gb=kv_gb + 0.5,
                              config=ZipageConfig(compress=False, block_size=block_size,
                                                  max_num_batched_tokens=max(16384, longest)))
    engine = build_engine(settings, "cuda", cuda_graphs=False)
    runner, scheduler = engine.runner, engine.new_scheduler()
    rows = []
    for mode in graphs:
        if mode != "off":
            # (read by each step's layout: the graphs, both per bucket, are captured once)
            runner_module.takes_decode_section = SECTION_RULES[mode]
        if mode != "off" and not runner.prefill_graphs:
            try:
                runner.enable_prefill_graphs()
            except Exception as error:  # noqa: BLE001 - the eager rows above still count
                rows.append({"model": model, "prefill_graphs": True, "error": repr(error)})
                print(json.dumps(rows[-1]), flush=True)
                break
        step_ids = itertools.count()
        for context in decode_contexts:
            running = decoding_requests(scheduler, shape, decodes, context)
            for tokens, cached in itertools.product(token_counts, cached_counts):
                row = time_step(runner, scheduler, shape, model, tokens, running, next(step_ids), repeats, cached)
                row.update(prefill_graphs=mode != "off", graphs_mode=mode, decodes=decodes, decode_context=context,
                           cached=cached, block_size=block_size,
                           roofline_s=roofline(model, tokens, bandwidth, flops, cached))
                row["vs_roofline"] = row["step_s"] / row["roofline_s"]
                rows.append(row)
                print(json.dumps(row), flush=True)
            for seq in running:
                scheduler.block_manager.release_all(seq.block_table)
    runner_module.takes_decode_section = SECTION_RULES["on"]
    del engine, runner
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def decoding_requests(scheduler, shape, count: int, context: int) -> dict:
    """`count` requests as a mixed step's decode rows: `context` cached entries each (random
    contents of the fresh cache), decoding their next token; and their token ids."""
    running = {}
    for index in range(count):
        seq = Sequence(f"d{index}", None, 1 << 20, prompt_len=context, sampling=GREEDY)
        seq.block_table = [scheduler.block_manager.allocate()
                           for _ in range(context // scheduler.block_manager.block_size + 1)]
        seq.set_counters(context, 1)
        running[seq] = [(5 * i) % shape.vocab_size for i in range(context + 1)]
    return running


def time_step(runner, scheduler, shape, model: str, tokens: int, running: dict, step_id: int,
              repeats: int, cached: int = 0) -> dict:
    """Median wall and GPU time of one prefill (or mixed) step of `tokens` prompt tokens, the
    chunk after `cached` of its prompt's entries (random contents of the cache)."""
    length = cached + tokens
    seq = Sequence(f"p{tokens}-{cached}", None, 4, prompt_len=length, sampling=GREEDY)
    seq.block_table = [scheduler.block_manager.allocate()
                       for _ in range(-(-length // scheduler.block_manager.block_size))]
    plan = StepPlan(step_id=step_id, kind=MIXED if running else PREFILL,
                    prefill=[PrefillItem(seq, cached, length)], decode=list(running))
    ids = {seq.seq_id: [(7 * i) % shape.vocab_size for i in range(length)]}
    ids.update({other.seq_id: history for other, history in running.items()})
    for _ in range(2):
        runner.execute(plan, ids)  # warm-up: Triton compiles for this shape
    torch.cuda.synchronize()
    walls, gpus = [], []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        started = time.perf_counter()
        start.record()
        runner.execute(plan, ids)
        end.record()
        walls.append(time.perf_counter() - started)
        torch.cuda.synchronize()
        gpus.append(start.elapsed_time(end) / 1e3)
    rows = tokens + len(running)
    row = {"model": model, "tokens": tokens, "step_s": statistics.median(walls),
           "gpu_s": statistics.median(gpus),
           "padded_bucket": next((b for b in runner.prefill_buckets if b >= rows), None),
           "spread": (max(walls) - min(walls)) / statistics.median(walls)}
    row.update(profile(runner, plan, ids))
    scheduler.block_manager.release_all(seq.block_table)
    return row


def profile(runner, plan: StepPlan, ids: dict) -> dict:
    """Kernel time, launches and the costliest host ops of one profiled step."""
    try:
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            runner.execute(plan, ids)
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        top = sorted(prof.key_averages(), key=lambda e: e.cpu_time_total, reverse=True)[:15]
        return {"kernel_s": sum(e.device_time for e in kernels) / 1e6, "launches": len(kernels),
                "top_cpu_ops": [(e.key, e.count, round(e.cpu_time_total / 1e3, 3)) for e in top],
                "top_kernels": kernel_breakdown(kernels)}
    except Exception as error:  # noqa: BLE001 - the timings above still count
        return {"kernel_s": float("nan"), "launches": -1, "profile_error": repr(error)}


def kernel_breakdown(kernels: list, top: int = 12) -> list[tuple[str, int, float, float]]:
    """The costliest kernels by name: (name, launches, total ms, shortest us). Where the kernel
    time of a small step goes: a few large kernels, or many at their latency floor."""
    groups: dict[str, list[float]] = {}
    for event in kernels:
        groups.setdefault(event.name[:70], []).append(event.device_time)
    rows = sorted(groups.items(), key=lambda item: sum(item[1]), reverse=True)[:top]
    return [(name, len(times), round(sum(times) / 1e3, 4), round(min(times), 2)) for name, times in rows]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="qwen3-0.6b,qwen3-8b")
    parser.add_argument("--tokens", default="128,512,2048,8192")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--prefill-graphs", default="both",
                        help="modes, a list of off (eager), on (padded prefill graphs), folded / sectioned "
                             "(graphs that never / always take the decode section); both = off,on")
    parser.add_argument("--decodes", type=int, default=0,
                        help="requests decoding beside each prompt (a mixed step)")
    parser.add_argument("--decode-context", default="1024",
                        help="cached entries of each decoding request (a list: one row each)")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--cached", default="0",
                        help="entries of each prompt already cached: the step computes its next chunk")
    parser.add_argument("--kernels", action="store_true",
                        help="also print each step's costliest kernels (they are always in the json)")
    args = parser.parse_args()
    modes = ("off", "on") if args.prefill_graphs == "both" else tuple(args.prefill_graphs.split(","))
    if not set(modes) <= {"off", *SECTION_RULES}:
        parser.error(f"--prefill-graphs: unknown mode in {args.prefill_graphs!r}; use off, on, folded, sectioned "
                     "or both")
    # $OUT when set (the GPU harness collects it), else the ignored runs/ of the repository.
    out = Path(os.environ.get("OUT")
               or Path(__file__).resolve().parents[1] / "runs" / "prefill_gpu")
    out.mkdir(parents=True, exist_ok=True)
    bandwidth, flops = copy_bandwidth(), matmul_flops()
    report = {"device": torch.cuda.get_device_name(), "copy_bandwidth": bandwidth,
              "matmul_flops": flops, "rows": []}
    for model in args.models.split(","):
        report["rows"] += measure(model, [int(t) for t in args.tokens.split(",")], args.repeats,
                                  bandwidth, flops, modes, args.decodes,
                                  tuple(int(c) for c in args.decode_context.split(",")),
                                  tuple(int(c) for c in args.cached.split(",")), args.block_size)
        (out / "prefill_gpu.json").write_text(json.dumps(report, indent=2))
    print(f"\n{report['device']}: copy {bandwidth / 1e12:.2f} TB/s, matmul {flops / 1e12:.0f} TFLOP/s")
    print(f"{'model':<12} {'graphs':>6} {'tokens':>6} {'cached':>6} {'decode ctx':>10} {'step ms':>8} "
          f"{'gpu ms':>7} {'kernels ms':>10} {'launches':>8} {'roofline ms':>11} {'x roofline':>10}")
    for row in report["rows"]:
        if "error" in row:
            print(f"{row['model']:<12} graphs on failed: {row['error']}")
            continue
        graphs = row["padded_bucket"] if row["prefill_graphs"] and row["padded_bucket"] else "-"
        if row["graphs_mode"] in ("folded", "sectioned") and row["padded_bucket"]:
            graphs = f"{graphs}{row['graphs_mode'][0]}"
        print(f"{row['model']:<12} {graphs:>6} {row['tokens']:>6} {row['cached']:>6} "
              f"{row['decode_context'] if row['decodes'] else '-':>10} {row['step_s'] * 1e3:>8.2f} "
              f"{row['gpu_s'] * 1e3:>7.2f} {row['kernel_s'] * 1e3:>10.2f} {row['launches']:>8} "
              f"{row['roofline_s'] * 1e3:>11.2f} {row['vs_roofline']:>10.2f}")
    if args.kernels:
        for row in report["rows"]:
            if "top_kernels" not in row:
                continue
            graphs = "graphed" if row["prefill_graphs"] and row["padded_bucket"] else "eager"
            print(f"\n{row['model']} {row['tokens']} tokens over {row['cached']}, {graphs}: launches, kernel ms, "
                  "shortest us")
            for name, count, total_ms, shortest_us in row["top_kernels"]:
                print(f"  {count:>4} {total_ms:>8.3f} {shortest_us:>7.1f}  {name}")


if __name__ == "__main__":
    main()
