"""The GPU-free twin server against the real one: `zipage serve` on the GPU and `zipage serve
--simulate` (the twin stepping in real time with a shipped profile of that GPU) behind the same
`zipage bench serve` of one online trace, with the offline simulator's prediction beside them.

Builds an AMC23-shaped trace (short prompts, long reasoning outputs) with Poisson arrivals, then
runs up to three parts, each `zipage` commands in subprocesses with the same knobs:

  engine  zipage serve --model random:MODEL ... &      zipage bench serve TRACE --url ...
  twin    zipage serve --simulate --model random:MODEL --hardware H --cost-model PROFILE ... &
          zipage bench serve TRACE --url ...
  sim     zipage replay TRACE --model MODEL --hardware H --cost-model PROFILE ...   (offline)

and prints TTFT p50/p90, TPOT p50, end-to-end p50/p90 and the makespan side by side, with
twin / engine ratios (the twin's question: does the live twin serve what the GPU serves?).
Two more parts, off by default:

  correct  zipage calibrate --quick --gpu --profile PROFILE ...   (writes corrected-profile.json:
           the profile re-scaled to this host, as a user would before trusting the twin; the
           twin and sim parts then also run with it, as `twin.corrected` and `sim.corrected`)
  offline  zipage replay TRACE --gpu ...   (the same trace offline: what serving itself costs)

`--repeat N` serves the trace N times on the engine (runs `engine`, `engine.r2`, ...): the ratios
are then against the engine runs' median, beside the engine's own spread (max - min over the
median), which no twin can be asked to beat. Each
part writes its run directory under $OUT (or --out) and the table is rebuilt from whatever parts
exist, so parts can run in separate calls. The defaults are the shipped profile's settings
(`sim/profiles/qwen3-8b-h200-b64-k512-zipage.json`: Qwen3-8B on an H200, blocks of 64, budget 512)
and ~200 requests (about a minute on an H200):

    . bench/env.sh && python bench/serve_simulate_gpu.py --wheels DIR_OF_SERVE_WHEELS

`--dry-run` runs the whole script on a machine without a GPU: the engine part is then a second
`--simulate` server (analytic cost model, so the columns differ by the two cost models), with a
small trace by default:

    python bench/serve_simulate_gpu.py --dry-run --out /tmp/ssg   # ~1 min on 2 CPU cores

`--wheels DIR` installs the serve extra's wheels first when the image lacks them (pip --no-index),
as bench/serve_gpu.py does.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_gpu import _free_port, _install_wheels, _stop, _twin_lag, _wait_healthy, _zipage  # noqa: E402

PROFILE = "qwen3-8b-h200-b64-k512-zipage"
PARTS = ("engine", "twin", "sim")
EXTRA_PARTS = ("correct", "offline")
# The table's columns: the parts' run directories (the corrected profile's twin and sim beside).
COLUMNS = ("engine", "offline", "twin", "twin.corrected", "sim", "sim.corrected")
CORRECTED = "corrected-profile.json"
ROWS = [("completed", "completed", "{:g}"), ("TTFT p50 s", "ttft_p50_s", "{:.3f}"),
        ("TTFT p90 s", "ttft_p90_s", "{:.3f}"), ("TPOT p50 ms", "tpot_p50_ms", "{:.2f}"),
        ("e2e p50 s", "e2e_p50_s", "{:.2f}"), ("e2e p90 s", "e2e_p90_s", "{:.2f}"),
        ("makespan s", "makespan_s", "{:.1f}"), ("output tok/s", "tps", "{:,.1f}")]
RATIO_KEYS = ("ttft_p50_s", "ttft_p90_s", "tpot_p50_ms", "e2e_p50_s", "e2e_p90_s", "makespan_s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-8b", help="preset; random weights on the GPU")
    parser.add_argument("--cost-model", default=PROFILE,
                        help=f"the twin's and the simulator's cost model (default {PROFILE})")
    parser.add_argument("--hardware", default="h200", help="the GPU the twin simulates")
    parser.add_argument("--kv-memory-gb", type=float, default=6.0)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--questions", type=int, default=None, help="default 24 (dry run 3)")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-output", type=int, default=None, help="default 2048 (dry run 256)")
    parser.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals, requests/s")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--repeat", type=int, default=1,
                        help="serve the trace this many times on the engine (its run-to-run spread)")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: the engine part is a --simulate server too (analytic)")
    parser.add_argument("--wheels", default=None, help="directory of the serve extra's wheels")
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/serve_simulate_gpu"))
    args = parser.parse_args()
    if args.repeat < 1:
        raise SystemExit(f"--repeat: got {args.repeat}, expected at least 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.wheels:
        _install_wheels(args.wheels)
    trace = out / "trace.json"
    _make_trace(args, trace)
    knobs = ["--kv-memory-gb", str(args.kv_memory_gb), "--block-size", str(args.block_size),
             "--budget", str(args.budget)]
    engine = (["--simulate", "--hardware", args.hardware, "--cost-model", "analytic"]
              if args.dry_run else ["--engine", "gpu"])
    corrected = out / CORRECTED
    for part in args.parts.split(","):
        started = time.perf_counter()
        if part == "correct":
            if args.dry_run:
                raise SystemExit("--parts correct: needs the GPU (drop --dry-run)")
            _zipage_shown("calibrate", "--quick", "--gpu", "--profile", args.cost_model,
                          "--model", f"random:{args.model}", *knobs, "--out", str(corrected))
        elif part == "engine":
            for name in engine_runs(args.repeat):
                _served(engine, args.model, knobs, trace, out / name)
        elif part == "offline":
            if args.dry_run:
                raise SystemExit("--parts offline: needs the GPU (drop --dry-run)")
            _zipage("replay", str(trace), "--gpu", "--model", f"random:{args.model}", *knobs,
                    "--json", "--no-progress", "--out", str(out / "offline"))
        elif part in ("twin", "sim"):
            profiles = [(part, args.cost_model)]
            if corrected.is_file():
                profiles.append((f"{part}.corrected", str(corrected)))
            for name, profile in profiles:
                if part == "twin":
                    _served(["--simulate", "--hardware", args.hardware, "--cost-model", profile],
                            args.model, knobs, trace, out / name)
                else:
                    _zipage("replay", str(trace), "--model", args.model, "--hardware",
                            args.hardware, "--cost-model", profile, *knobs, "--json",
                            "--no-progress", "--out", str(out / name))
        else:
            raise SystemExit(f"--parts: unknown part {part!r}; use "
                             f"{', '.join(PARTS + EXTRA_PARTS)}")
        print(f"{part}: done in {time.perf_counter() - started:.0f} s", flush=True)
    _table(out)


def engine_runs(repeat: int) -> list[str]:
    """The engine part's run directories: `engine`, then `engine.r2` ... (as sessions_gpu names
    its repeats)."""
    return ["engine"] + [f"engine.r{index}" for index in range(2, repeat + 1)]


def _make_trace(args, path: Path) -> None:
    from zipage.trace import save_trace, stamp_arrivals
    from zipage.workloads import make_trace

    questions = args.questions or (3 if args.dry_run else 24)
    max_output = args.max_output or (256 if args.dry_run else 2048)
    trace = make_trace("amc23", 0, num_questions=questions, samples_per_question=args.samples,
                       max_output_len=max_output)
    save_trace(stamp_arrivals(trace, args.rate, seed=0), path)


def _served(mode: list[str], model: str, knobs: list[str], trace: Path, out: Path) -> None:
    """One server of `mode`, `zipage bench serve` against it, and the server's CPU seconds."""
    port = _free_port()
    out.mkdir(parents=True, exist_ok=True)
    log_path = out.parent / f"{out.name}-server.log"
    with log_path.open("w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "zipage.cli", "serve", *mode, "--model", f"random:{model}",
             "--served-model-name", model, *knobs, "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(server, url, log_path)
        _zipage("bench", "serve", str(trace), "--url", url, "--json", "--no-progress",
                "--out", str(out))
        cpu = _cpu_seconds(server.pid)
        if "--simulate" in mode:  # how far the twin's steps ran behind their predicted ends
            cpu["twin lag"] = _twin_lag(url)
        (out.parent / f"{out.name}-server-cpu.json").write_text(json.dumps(cpu) + "\n")
    finally:
        _stop(server)


def _zipage_shown(*argv: str) -> None:
    """A `zipage` command whose output is part of the report (the quick correction's scales).
    A refusal (exit 2: no re-scaling explains the anchors) is a result, not a failure: the
    other parts run on."""
    status = subprocess.run([sys.executable, "-m", "zipage.cli", *argv]).returncode
    if status not in (0, 2):
        raise SystemExit(f"zipage {argv[0]}: exit {status}")


def _cpu_seconds(pid: int) -> dict:
    """CPU seconds (user + system) of the server and of its children so far (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        process = int(stat.parent.name)
        if process == pid or int(fields[1]) == pid:
            found["http" if process == pid else f"engine {process}"] = \
                (int(fields[11]) + int(fields[12])) / tick
    return found


def _summary(directory: Path) -> dict:
    """The run's summary with end-to-end latency percentiles from its requests."""
    from zipage.core.metrics import percentile
    from zipage.rundir import load_run

    run = load_run(directory)
    summary = dict(run.summary)
    e2e = [finish - arrival for arrival, finish in zip(run.requests["arrival"],
                                                       run.requests["finish"])
           if finish == finish]  # (NaN: a request that did not finish)
    summary["e2e_p50_s"] = percentile(e2e, 50) if e2e else None
    summary["e2e_p90_s"] = percentile(e2e, 90) if e2e else None
    return summary


def _table(out: Path) -> None:
    runs = {part: _summary(out / part) for part in COLUMNS
            if (out / part / "summary.json").is_file()}
    if not runs:
        return
    report = {part: {key: summary.get(key) for _, key, _ in ROWS} for part, summary in runs.items()}
    repeats = [_summary(directory) for directory in sorted(out.glob("engine.r*"))
               if (directory / "summary.json").is_file()]
    if "engine" in runs and repeats:
        engine_all = [runs["engine"], *repeats]
        report["engine_runs"] = [{key: summary.get(key) for _, key, _ in ROWS} for summary in engine_all]
        # The engine column becomes the runs' median, and its spread goes beside the ratios.
        report["engine"] = {key: _median([summary.get(key) for summary in engine_all])
                            for _, key, _ in ROWS}
        report["engine_spread"] = {key: _spread([summary.get(key) for summary in engine_all])
                                   for key in RATIO_KEYS}
    for part in ("twin", "twin.corrected", "offline"):
        if "engine" in report and part in report:
            report[f"{part}_over_engine"] = {
                key: report[part][key] / report["engine"][key]
                for key in RATIO_KEYS if report["engine"][key] and report[part][key] is not None}
    for part in ("engine", "twin", "twin.corrected"):
        cpu = out / f"{part}-server-cpu.json"
        if cpu.is_file():
            report.setdefault("server_cpu_s", {})[part] = json.loads(cpu.read_text())
    (out / "serve_simulate_gpu.json").write_text(json.dumps(report, indent=2) + "\n")
    engine_label = f"engine x{len(report['engine_runs'])}" if "engine_runs" in report else "engine"
    parts = [part for part in COLUMNS if part in report]
    ratios = [part for part in ("twin", "twin.corrected", "offline")
              if f"{part}_over_engine" in report]
    spread = report.get("engine_spread")
    print(f"\n{'':<14}" + "".join(f"{engine_label if part == 'engine' else part:>15}"
                                   for part in parts)
          + "".join(f"{part + '/engine':>22}" for part in ratios)
          + ("   engine spread" if spread else ""))
    for label, key, pattern in ROWS:
        cells = [report[part].get(key) for part in parts]
        width = spread.get(key) if spread else None
        print(f"{label:<14}" + "".join(
            f"{'-' if value is None else pattern.format(value):>15}" for value in cells)
            + "".join(f"{report[f'{part}_over_engine'][key]:>22.3f}"
                      if key in report[f"{part}_over_engine"] else f"{'':>22}" for part in ratios)
            + (f"{width:>17.1%}" if width is not None else ""))
    for part, cpu in report.get("server_cpu_s", {}).items():
        print(f"{part} server CPU s: " + ", ".join(f"{name} {seconds:.1f}"
                                                  for name, seconds in cpu.items()))


def _median(values: list) -> float | None:
    from zipage.core.metrics import percentile

    known = [value for value in values if value is not None]
    return percentile(known, 50) if known else None


def _spread(values: list) -> float | None:
    """(max - min) / median of the engine runs' values: how far the engine is from itself."""
    known = [value for value in values if value is not None]
    center = _median(known)
    return (max(known) - min(known)) / center if known and center else None


if __name__ == "__main__":
    main()
