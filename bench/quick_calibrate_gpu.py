"""`zipage calibrate --quick` on a GPU against the shipped H200 profiles, then the headline trace
with and without the correction (issue #49; docs/cost_model.md, 'Quick correction').

For each mode (fullkv, zipage), as `zipage` commands in subprocesses, from /tmp (the checkout's
own zipage/ would shadow bench/env.sh's tree):

1. `zipage calibrate --quick --gpu --profile SHIPPED ...`: the shipped profile re-scaled to this
   machine, timed end to end (engine build and warm-up included: the target is <= 2 minutes);
2. `zipage fidelity --gpu ... --cost-model SHIPPED --quick-correct --traces 0 --trace HEADLINE`:
   the headline trace (traces/amc23-headline.json) through the engine once, simulated with the
   shipped profile, with its quick correction on this machine (made again on fidelity's own
   engine) and with the analytic model.

Random Qwen3-8B weights, 6 GB of KV, blocks of 64, budget 512: the shipped profiles' settings
(sim/profiles/qwen3-8b-h200-b64-k512-{fullkv,zipage}.json). Logs, the corrected profiles and
fidelity.json per mode go under --out ($OUT); the table comes last (quick_calibrate.json too).
Full KV's headline run takes ~195 s and Zipage's ~70 s, so one mode per 10-minute call:

    . bench/env.sh && python bench/quick_calibrate_gpu.py --modes fullkv --out $OUT
    . bench/env.sh && python bench/quick_calibrate_gpu.py --modes zipage --out $OUT

A dry run on a machine without a GPU (`--engine cpu`) first makes a small CPU profile with the
full `zipage calibrate` (the shipped profiles are the GPU's), then runs the same two steps on a
small trace, Zipage only. With a tiny HF model directory (tests/tiny_models.py writes one) it
takes a few minutes on 2 cores; random:smollm2-135m works too, but its decode step of ~0.1-0.7 s
on a loaded 2-core host makes the anchors alone take tens of minutes:

    python bench/quick_calibrate_gpu.py --engine cpu --model TINY_MODEL_DIR --out /tmp/qcg
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = {"fullkv": "qwen3-8b-h200-b64-k512-fullkv", "zipage": "qwen3-8b-h200-b64-k512-zipage"}
HEADLINE = ROOT / "traces" / "amc23-headline.json"
# The figures of each fidelity row the table shows: the transfer errors.
METRICS = ("makespan", "tpot_p50", "ttft_p50", "e2e_mape")
# The CPU dry run: a deployment small enough for 2 cores, its own profile's fitting seconds and
# the requests of its trace.
CPU_KNOBS = ["--block-size", "16", "--window", "4", "--budget", "128", "--max-model-len", "512",
             "--kv-memory-gb", "0.05", "--hardware", "h200", "--dtype", "float32"]
CPU_FIT_SECONDS, CPU_VALIDATION_SECONDS, CPU_TRACE_REQUESTS = 6.0, 3.0, 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="fullkv,zipage",
                        help="comma list of fullkv, zipage (default both)")
    parser.add_argument("--engine", choices=("gpu", "cpu"), default="gpu",
                        help="cpu: the dry run (its own small profile, a small trace)")
    parser.add_argument("--model", default="random:qwen3-8b")
    parser.add_argument("--kv-memory-gb", type=float, default=6.0)
    parser.add_argument("--max-scale", type=float, default=None,
                        help="passed to calibrate --quick and fidelity (default: theirs)")
    parser.add_argument("--trace", default=str(HEADLINE),
                        help="the trace fidelity checks on (default the headline)")
    parser.add_argument("--out", default=os.environ.get("OUT"),
                        help="folder for logs, profiles and the table (default $OUT)")
    args = parser.parse_args()
    if not args.out:
        parser.error("--out: give a folder (or set $OUT)")
    modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    unknown = sorted(set(modes) - set(SHIPPED))
    if unknown or not modes:
        parser.error(f"--modes: unknown {', '.join(unknown) or 'empty list'}; give fullkv, zipage")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.engine == "cpu":
        modes, trace = ["zipage"], small_trace(out)
    else:
        trace = Path(args.trace).resolve()
    results = {}
    for mode in modes:
        flags = deployment(args, mode)
        profile = SHIPPED[mode] if args.engine == "gpu" else cpu_profile(flags, out)
        if args.max_scale is not None:
            flags = flags + ["--max-scale", f"{args.max_scale:g}"]
        results[mode] = run_mode(mode, profile, flags, trace, out)
    (out / "quick_calibrate.json").write_text(json.dumps(results, indent=1) + "\n")
    print_table(results)


def deployment(args: argparse.Namespace, mode: str) -> list[str]:
    """The engine flags of `mode`: the shipped profiles' on the GPU, CPU_KNOBS on the CPU."""
    if args.engine == "cpu":
        flags = ["--engine", "cpu", "--model", args.model, *CPU_KNOBS]
    else:
        flags = ["--gpu", "--model", args.model, "--kv-memory-gb", f"{args.kv_memory_gb:g}",
                 "--block-size", "64", "--budget", "512"]
    return flags + (["--no-compress"] if mode == "fullkv" else [])


def zipage(argv: list[str], log: Path) -> tuple[int, float]:
    """`zipage ARGV` from /tmp, its output teed into `log`; its exit status and wall seconds."""
    started = time.perf_counter()
    with open(log, "w") as handle:
        process = subprocess.Popen([sys.executable, "-m", "zipage.cli", *argv], cwd="/tmp",
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in process.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            handle.write(line)
        status = process.wait()
    return status, time.perf_counter() - started


def cpu_profile(flags: list[str], out: Path) -> str:
    """The dry run's profile: a full `zipage calibrate` of the CPU engine, kept short."""
    path = out / "cpu-profile.json"
    status, _ = zipage(["calibrate", *flags, "--fit-seconds", f"{CPU_FIT_SECONDS:g}",
                        "--validation-seconds", f"{CPU_VALIDATION_SECONDS:g}", "--no-progress",
                        "--out", str(path)], out / "cpu-profile.log")
    if status != 0:
        sys.exit(f"the CPU profile failed (exit {status}): {out / 'cpu-profile.log'}")
    return str(path)


def small_trace(out: Path) -> Path:
    path = out / "small-trace.json"
    path.write_text(json.dumps({"version": 1, "name": "small", "requests": [
        {"id": f"s{index}", "arrival_s": 0.05 * index, "prompt_len": 40 + 7 * index,
         "output_len": 48} for index in range(CPU_TRACE_REQUESTS)]}))
    return path


def run_mode(mode: str, profile: str, flags: list[str], trace: Path, out: Path) -> dict:
    quick_out = out / f"{mode}-quick.json"
    status, seconds = zipage(["calibrate", "--quick", "--profile", profile, *flags,
                              "--out", str(quick_out)], out / f"{mode}-quick.log")
    result: dict = {"profile": profile, "quick_status": status, "quick_wall_s": round(seconds, 1)}
    if status == 0:
        correction = json.loads(quick_out.read_text())["correction"]
        result["quick"] = {key: correction.get(key) for key in
                           ("model", "scales", "worst_residual", "considered", "elapsed_s")}
        result["quick"]["anchors"] = correction["anchors"]
    fidelity_out = out / f"{mode}-fidelity"
    status, seconds = zipage(["fidelity", *flags, "--cost-model", profile, "--quick-correct",
                              "--traces", "0", "--trace", str(trace), "--no-progress",
                              "--out", str(fidelity_out)], out / f"{mode}-fidelity.log")
    result.update(fidelity_status=status, fidelity_wall_s=round(seconds, 1))
    report = fidelity_out / "fidelity.json"
    if status == 0 and report.is_file():
        data = json.loads(report.read_text())
        result["rows"] = {row["model"]: {metric: row.get(metric) for metric in METRICS}
                          for row in data["rows"]}
        result["fidelity_correction"] = {key: data["correction"].get(key) for key in
                                         ("model", "scales", "worst_residual", "refusal")}
    return result


def print_table(results: dict) -> None:
    print("\nquick correction (the profile re-scaled to this machine):")
    print(f"{'mode':<8} {'status':>6} {'wall s':>7} {'model':<20} {'worst':>6}  scales")
    for mode, result in results.items():
        quick = result.get("quick") or {}
        scales = ", ".join(f"{group} {value:.3f}" for group, value in
                           (quick.get("scales") or {}).items())
        worst = quick.get("worst_residual")
        print(f"{mode:<8} {result['quick_status']:>6} {result['quick_wall_s']:>7.1f} "
              f"{quick.get('model', '-'):<20} {'-' if worst is None else f'{worst:.1%}':>6}  "
              f"{scales or 'refused: see the log'}")
    print("\ntransfer error on the trace, (simulated - engine) / engine:")
    print(f"{'mode':<8} {'model':<10} " + " ".join(f"{metric:>9}" for metric in METRICS))
    for mode, result in results.items():
        for model, row in (result.get("rows") or {}).items():
            cells = ["-" if row[metric] is None else f"{100 * row[metric]:+.1f}%"
                     for metric in METRICS]
            print(f"{mode:<8} {model:<10} " + " ".join(f"{cell:>9}" for cell in cells))


if __name__ == "__main__":
    main()
