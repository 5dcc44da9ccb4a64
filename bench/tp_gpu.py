"""Tensor parallelism on two GPUs (run on nvidia-h200-x2; results go to docs/BENCHMARKS.md).

Part A - decode step, TP=1 vs TP=2: random:qwen3-8b at batch 32/128/256 with 2k-token contexts,
one whole engine step (inputs, forward with CUDA graphs, logits gather, sampling), against the
bandwidth roofline of the GPUs it runs on: (weight bytes + KV bytes read) / N / copy bandwidth.

Part B - the headline on random:qwen3-32b at TP=2: an AMC23-shaped trace (as bench/headline_gpu.py,
lengths scaled to fit a 10-minute call), Full KV then Zipage, KV memory per GPU capped so that
Full KV is memory-bound; output tokens/s of each and the ratio, and the simulator's analytic
prediction of the same runs (--tensor-parallel 2 on an H200).

Part C - runs to fit calibrated profiles from (`zipage calibrate --from-run`): the same engine
settings on a *different* trace (GSM8K-shaped: short outputs), Full KV and Zipage, so the
calibrated simulator's prediction of part B is made with a profile that never saw part B's trace.

Every engine (a decode world of part A, a variant of parts B and C) is built, run and closed in a
process of its own under a watchdog (--job-timeout): a collective or teardown that never returns
costs that job, not the call, and leaves every process's stack in logs/JOB.log (faulthandler).
Parts B and C write their run directories (summary.json, steps.csv, requests.csv) under
$OUT/runs/; runs, logs and per-job results are packed as $OUT/tp_runs.tar.gz.

    . bench/env.sh && python bench/tp_gpu.py [--parts A,B,C] [--questions 8 --samples 8 ...]

Prints a table last and writes tp_gpu.json under $OUT (or runs/<script>/ of the repository).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

# The single-GPU decode benchmark's bandwidth probe and decode-step timing (bench/ is the
# script's path); here with tensor_parallel ranks.
from engine_gpu import copy_bandwidth, decode_roofline  # noqa: E402

from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings
from zipage.engine.replay import replay_on_engine
from zipage.rundir import write_run
from zipage.trace import Trace, load_trace, save_trace
from zipage.workloads import make_trace

DEVICE = os.environ.get("ZIPAGE_BENCH_DEVICE", "cuda")  # "cpu": a smoke run of parts B and C


def headline_variant(args, out: Path, trace_kind: str, label: str, name: str) -> dict:
    """One engine run (`name`: full-kv or zipage, ".2" for a second run) of part B's or part C's
    trace, and the simulator's analytic prediction of it; the run directory goes under runs/."""
    if trace_kind == "amc23":
        trace = make_trace("amc23", 0, num_questions=args.questions,
                           samples_per_question=args.samples, max_output_len=args.max_output)
    elif args.fit_trace:  # part C on a trace file (e.g. with arrivals: many prefill sizes)
        trace = load_trace(args.fit_trace)
        trace = Trace(trace.name, trace.requests[:args.fit_head])
    else:
        trace = make_trace(trace_kind, 1, num_questions=args.fit_questions,
                           samples_per_question=4, max_output_len=args.max_output)
    save_trace(trace, out / "runs" / f"{label}-trace.json")
    config = ZipageConfig(block_size=args.block_size, window=args.window, kv_budget=args.budget,
                          **(dict(compress=False) if name.startswith("full-kv") else {}))
    settings = ReplaySettings(model=f"random:{args.model}", hardware="h200-141gb",
                              kv_memory_gb=args.kv_memory_gb, tensor_parallel=args.tp,
                              config=config)
    row = {"model": args.model, "tp": args.tp, "trace": trace_kind, "requests": len(trace.requests),
           "output_tokens": sum(r.output_len for r in trace.requests)}
    started = time.perf_counter()
    try:
        summary, run = replay_on_engine(trace, settings, DEVICE)
    except Exception:  # noqa: BLE001 - e.g. a collective that a CUDA graph cannot capture
        row["graph_error"] = traceback.format_exc()
        traceback.print_exc()
        summary, run = replay_on_engine(trace, settings, DEVICE, cuda_graphs=False)
        summary["cuda_graphs"] = False
    row["wall_s"] = time.perf_counter() - started  # build + run + close
    write_run(out / "runs" / f"{label}-{name}", summary, run.steps, run.requests, [],
              decisions="none")
    row.update({key: summary.get(key) for key in (
        "tps", "makespan_s", "peak_running", "mean_running", "preemptions", "compressions",
        "num_blocks", "steps", "tpot_p50_ms", "ttft_p50_s", "mean_kept_budget")})
    try:  # the GPU image has no simpy unless its wheel is carried: then simulate here later
        from zipage.sim.simulate import simulate

        row["simulated_tps"] = simulate(trace, settings)[0]["tps"]
    except ImportError as error:
        row["simulated_tps"] = None
        row["simulated_error"] = str(error)
    print(name, json.dumps(row), flush=True)
    return row


# ---------------------------------------------------------------- one job per process
#
# Each engine is built, run and closed in a process of its own, under a watchdog: an NCCL
# collective or teardown that never returns costs that job its time limit, not the call, and
# Python's faulthandler (SIGABRT) prints where every process of the job waits.

JOBS = {"A1": "part A, TP=1 decode steps", "A2": "part A, TP=2 decode steps",
        "B-full-kv": "part B, Full KV", "B-zipage": "part B, Zipage",
        "C-full-kv": "part C, Full KV", "C-zipage": "part C, Zipage"}


def run_job(job: str, args, out: Path) -> dict:
    """The body of one job, in its own process; returns what goes into the report."""
    if job.startswith("A"):
        world = int(job[1:])
        return {"bandwidth": (bandwidth := copy_bandwidth()),
                "rows": decode_roofline(args.decode_model,
                                        [int(b) for b in args.batches.split(",")],
                                        bandwidth, tensor_parallel=world, eager=False)}
    part, name = job.split("-", 1)
    return headline_variant(args, out, "amc23" if part == "B" else "gsm8k",
                            "headline" if part == "B" else "fit", name)


def launch(job: str, argv: list[str], out: Path, limit_s: float) -> dict:
    """Run `job` in a child process; on a hang, dump every process's stack, then kill them."""
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    log = (out / "logs" / f"{job}.log").open("w")
    started = time.perf_counter()
    child = subprocess.Popen([sys.executable, __file__, *argv, "--job", job], stdout=log,
                             stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        code = child.wait(timeout=limit_s)
        status = "ok" if code == 0 else f"exit {code}"
    except subprocess.TimeoutExpired:
        status = f"hung: killed after {limit_s:.0f} s (stacks in logs/{job}.log)"
        os.killpg(child.pid, signal.SIGABRT)  # faulthandler prints the stacks of the group
        time.sleep(5)
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    log.close()
    result_file = out / "jobs" / f"{job}.json"
    result = json.loads(result_file.read_text()) if result_file.exists() else {}
    result.update(status=status, process_s=time.perf_counter() - started)
    print(f"[{job}] {JOBS[job.split('.')[0]]}: {status}, {result['process_s']:.0f} s", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="A,B")
    parser.add_argument("--decode-model", default="qwen3-8b")
    parser.add_argument("--batches", default="32,128,256")
    parser.add_argument("--decode-worlds", default=None, help="part A's ranks (default: 1,TP)")
    parser.add_argument("--model", default="qwen3-32b")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-output", type=int, default=2048)
    parser.add_argument("--kv-memory-gb", type=float, default=3.0,
                        help="per GPU; Qwen3-32B at TP=2 holds 128 KiB of KV per token per GPU")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--variants", default="full-kv,zipage",
                        help="parts B and C: which engines, in this order (zipage twice: two runs)")
    parser.add_argument("--fit-questions", type=int, default=24,
                        help="part C: GSM8K-shaped questions (4 samples each)")
    parser.add_argument("--fit-trace", default=None,
                        help="part C: replay this trace file instead (its first --fit-head "
                             "requests)")
    parser.add_argument("--fit-head", type=int, default=None)
    parser.add_argument("--job-timeout", type=float, default=300.0,
                        help="seconds one job (one engine: build, run, close) may take")
    parser.add_argument("--deadline", type=float, default=570.0,
                        help="seconds for all jobs; a job that would not fit is skipped")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    # $OUT when set (the GPU harness collects it), else the ignored runs/ of the repository.
    out = Path(os.environ.get("OUT")
               or Path(__file__).resolve().parents[1] / "runs" / "tp_gpu")
    out.mkdir(parents=True, exist_ok=True)
    if args.job:  # a child: one job, its result as JSON
        result = run_job(args.job, args, out)
        (out / "jobs").mkdir(parents=True, exist_ok=True)
        (out / "jobs" / f"{args.job}.json").write_text(json.dumps(result, indent=2))
        return
    for folder in ("jobs", "logs", "runs"):
        (out / folder).mkdir(parents=True, exist_ok=True)
    argv = sys.argv[1:]
    parts = args.parts.split(",")
    # The headline (B) first: what is left of the deadline goes to the decode rows, then C.
    variants = numbered(args.variants.split(","))
    jobs = [f"B-{name}" for name in variants if "B" in parts]
    jobs += [f"A{w}" for w in (args.decode_worlds or f"1,{args.tp}").split(",") if "A" in parts]
    jobs += [f"C-{name}" for name in variants if "C" in parts]
    started = time.perf_counter()
    report: dict = {"args": vars(args), "gpus": torch.cuda.device_count(), "jobs": {}}
    for job in jobs:
        left = args.deadline - (time.perf_counter() - started)
        if left < 60:
            report["jobs"][job] = {"status": f"skipped: {left:.0f} s left of --deadline"}
            print(f"[{job}] skipped ({left:.0f} s left)", flush=True)
            continue
        report["jobs"][job] = launch(job, argv, out, min(args.job_timeout, left))
        (out / "tp_gpu.json").write_text(json.dumps(report, indent=2))
    subprocess.run(["tar", "czf", str(out / "tp_runs.tar.gz"), "-C", str(out), "runs", "logs",
                    "jobs"], check=False)
    print_tables(report)


def numbered(names: list[str]) -> list[str]:
    """A name's second and later runs get a number: zipage,zipage -> zipage, zipage.2."""
    return [name if names[:index].count(name) == 0 else f"{name}.{names[:index].count(name) + 1}"
            for index, name in enumerate(names)]


def print_tables(report: dict) -> None:
    jobs = report["jobs"]
    print(f"\n{'model':<10} {'tp':>3} {'batch':>6} {'step ms':>8} {'roofline ms':>12} {'share':>6}")
    for job in ("A1", "A2"):
        for row in jobs.get(job, {}).get("rows", []):
            print(f"{row['model']:<10} {row['tp']:>3} {row['batch']:>6} {row['graphs'] * 1e3:>8.2f} "
                  f"{row['roofline_s'] * 1e3:>12.2f} {row['bandwidth_share']:>6.0%}")
    for part in ("B", "C"):
        rows = {job.split("-", 1)[1]: row for job, row in jobs.items() if job[0] == part}
        if not rows:
            continue
        print(f"\npart {part}:")
        for name, row in rows.items():
            if "tps" not in row:
                print(f"{name:<10} {row.get('status', 'not run')}")
                continue
            print(f"{name:<10} {row['tps']:>9.1f} tok/s  makespan {row['makespan_s']:.1f} s  "
                  f"peak running {row['peak_running']}  preemptions {row['preemptions']}  "
                  f"compressions {row['compressions']}  simulated {row['simulated_tps']}  "
                  f"build+run+close {row['wall_s']:.0f} s  [{row['status']}]")
        full_kv = rows.get("full-kv", {}).get("tps")
        for name, row in rows.items():
            if name.startswith("zipage") and full_kv and "tps" in row:
                print(f"{name} / full-kv: {row['tps'] / full_kv:.2f}x")


if __name__ == "__main__":
    main()
