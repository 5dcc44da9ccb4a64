"""GPU probe: where the host waits in the first steps of an engine run, sync and async.

The async engine records the 8B headline's opening prefill at 92-98 ms against 45 ms synchronously
(docs/BENCHMARKS.md, 'Async scheduling'): the host returns from `launch` of the first big steps only
after about their device time. This runs the headline's first `--steps` steps (the trace's requests
cut to `--output` tokens) synchronously and async on one engine (by default after a run of each to
warm up; `--profile-from 0` probes the engine's first run too), and for each step prints the host's
time inside the runner's call and what the host waited in there: CUDA calls that synchronize
(torch's sync debug mode, with the Python line that made them) and the longest CUDA runtime calls
under torch.profiler but the waits for tokens (a kernel launch that blocks means the device's
launch queue was full). A wait no runtime call shows is read from the chrome traces it writes.

    python bench/async_first_steps_gpu.py --trace traces/amc23-headline.json --steps 4

Writes first_steps.json and one chrome trace a mode under $OUT (or runs/first_steps/).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
import traceback
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings, effective_config, trace_sequences
from zipage.core.sampling import SamplingParams
from zipage.engine.builder import build_engine
from zipage.engine.loop import EngineLoop
from zipage.trace import load_trace

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


class Probe:
    """Wraps the runner's `execute` and `launch`: the host's time in each call of the first
    `steps`, and the synchronizing CUDA calls made inside (with where they were made)."""

    def __init__(self, runner, steps: int):
        self.runner, self.steps, self.calls = runner, steps, []
        self.originals = {name: getattr(runner, name) for name in ("execute", "launch")}
        for name, original in self.originals.items():
            setattr(runner, name, self._wrapped(name, original))

    def close(self) -> None:
        for name, original in self.originals.items():
            setattr(self.runner, name, original)

    def _wrapped(self, name, original):
        def call(plan, *args, **kwargs):
            if len(self.calls) >= self.steps:
                return original(plan, *args, **kwargs)
            syncs = []

            def seen(message, category, filename, lineno, file=None, line=None):
                stack = [frame for frame in traceback.extract_stack()[:-1]
                         if "/zipage/" in frame.filename or "/kernels/" in frame.filename]
                where = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in stack[-3:]]
                syncs.append({"message": str(message)[:120], "where": where})

            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("warn")
            started = time.perf_counter()
            try:
                with warnings.catch_warnings():  # restores the filters and showwarning on exit
                    warnings.simplefilter("always")
                    warnings.showwarning = seen
                    result = original(plan, *args, **kwargs)
            finally:
                host_ms = (time.perf_counter() - started) * 1000
                if torch.cuda.is_available():
                    torch.cuda.set_sync_debug_mode("default")
            tokens = sum(item.num_new_tokens for item in plan.prefill) + len(plan.decode)
            self.calls.append({"call": name, "step": plan.step_id, "kind": plan.kind, "tokens": tokens,
                               "graphed": plan.kind == "decode" or tokens <= max(self.runner.prefill_buckets,
                                                                                  default=0),
                               "host_ms": host_ms, "syncs": syncs})
            return result
        return call


def first_steps(engine, settings, trace, mode: bool, steps: int, output: int, out: Path, profiled: bool,
                index: int):
    config = dataclasses.replace(effective_config(settings, engine.shape), async_scheduling=mode)
    scheduler = engine.new_scheduler(config)
    sequences = trace_sequences(trace, engine.shape.vocab_size, need_tokens=True, scheduler=scheduler)
    for seq in sequences:
        seq.sampling = GREEDY
        seq.max_output_tokens = min(seq.max_output_tokens, output)
    loop = EngineLoop(scheduler, engine.runner)
    probe = Probe(engine.runner, steps)
    try:
        if profiled:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run = loop.run(sequences)
            prof.export_chrome_trace(str(out / f"first-steps-{index}-{'async' if mode else 'sync'}.json"))
            # The host's waits for tokens are expected; any other long CUDA runtime call is not.
            runtime = [event for event in prof.events() if event.name.startswith("cuda")
                       and event.name not in ("cudaEventSynchronize", "cudaStreamSynchronize")]
            runtime.sort(key=lambda event: -event.cpu_time_total)
            longest = [{"name": event.name, "ms": event.cpu_time_total / 1000} for event in runtime[:8]]
        else:
            run = loop.run(sequences)
            longest = []
    finally:
        probe.close()
    records = run.steps[:steps]
    return {"mode": "async" if mode else "sync", "calls": probe.calls, "longest_cuda_calls": longest,
            "steps": [{"step": r.step_id, "kind": r.kind, "ms": (r.t_end - r.t_start) * 1000,
                       "planned_at_ms": (getattr(r, "planned_at", -1) - records[0].t_start) * 1000}
                      for r in records]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trace", default="traces/amc23-headline.json")
    parser.add_argument("--model", default="random:qwen3-8b")
    parser.add_argument("--kv-memory-gb", type=float, default=6)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--output", type=int, default=16, help="tokens a request generates (the run is cut short)")
    parser.add_argument("--modes", default="sync,async,sync,async",
                        help="the runs, in order, on one engine (the first is the engine's first run)")
    parser.add_argument("--profile-from", type=int, default=2,
                        help="the runs before this index are warm-up runs, not profiled nor probed")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (no profile)")
    args = parser.parse_args()
    config = ZipageConfig(block_size=64, kv_budget=512)
    settings = ReplaySettings(model=args.model, hardware="h200", kv_memory_gb=args.kv_memory_gb, config=config)
    trace = load_trace(args.trace)
    out = Path(os.environ.get("OUT") or Path(__file__).resolve().parents[1] / "runs" / "first_steps")
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    engine = build_engine(settings, args.device)
    built_s = time.perf_counter() - started
    warmed = time.perf_counter()
    engine.runner.warm_logits()  # again, timed: what the warm-up's LM-head pass costs
    print(f"engine built and warmed up in {built_s:.1f} s; the LM-head pass {time.perf_counter() - warmed:.2f} s")
    cuda = engine.device.type == "cuda"
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu",
              "prefill_buckets": list(engine.runner.prefill_buckets), "runs": []}
    try:
        for mode in (name == "async" for name in args.modes.split(",")):
            warm = len(report["runs"]) < args.profile_from
            result = first_steps(engine, settings, trace, mode, args.steps, args.output, out,
                                 profiled=cuda and not warm, index=len(report["runs"]))
            if not warm:
                report["runs"].append(result)
            else:
                report["runs"].append({"mode": result["mode"], "warm_up": True, "steps": result["steps"]})
    finally:
        engine.close()
    (out / "first_steps.json").write_text(json.dumps(report, indent=1))
    print(f"{report['device']}: prefill buckets up to {max(report['prefill_buckets'], default=0)} tokens")
    for result in report["runs"]:
        print(f"\n{result['mode']}{' (warm-up run)' if result.get('warm_up') else ''}: recorded steps "
              + ", ".join(f"{s['kind']} {s['ms']:.1f} ms (planned {s['planned_at_ms']:.1f})" for s in result["steps"]))
        for call in result.get("calls", []):
            print(f"  {call['call']} step {call['step']} {call['kind']} {call['tokens']} tokens"
                  f"{' graphed' if call['graphed'] else ' eager'}: host {call['host_ms']:.1f} ms, "
                  f"{len(call['syncs'])} synchronizing calls")
            for sync in call["syncs"][:6]:
                print(f"    {sync['message'][:70]} at {' < '.join(reversed(sync['where']))}")
        for event in result.get("longest_cuda_calls", []):
            print(f"  longest CUDA call: {event['name']} {event['ms']:.1f} ms")


if __name__ == "__main__":
    main()
