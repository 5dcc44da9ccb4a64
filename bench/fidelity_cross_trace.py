"""Twin fidelity across traces, one model and mode (issue #15; docs/cost_model.md, 'Twin fidelity
across traces: what the error is made of'). bench/fidelity_matrix.py, which extends it to two
models and both modes, builds on its `Study`.

For each of three traces — the AMC23 headline, the online mixture and the first 200 requests of
the LongBench-shaped trace — fit a profile on the H200 engine runs of the *other* two traces
(`zipage calibrate --from-run`), simulate this trace with it and with the analytic model
(`zipage replay TRACE --cost-model ... --out SIM`) and compare with each engine run of this trace
(`zipage compare SIM RUN`). Also: the step-time replay of every engine run (`zipage replay TRACE
--step-times RUN`: the core must make the engine's decisions, here checked column by column on
steps.csv because the runs were written without decision logs); Full KV on LongBench; and the
attribution of the error, by replacing one part of the cross-trace profile (prefill, decode or
compression points) with the part fitted on the evaluated run itself.

    python bench/fidelity_cross_trace.py --runs RUNS_DIR [--out runs/fidelity_cross_trace]

RUNS_DIR holds engine run directories of random Qwen3-8B on an H200 (6 GB KV, block 64, budget
512, async compression), made with `bench/headline_gpu.py --no-simulate --runs-dir DIR`; the
layout is RUNS and FULL_KV below (a folder per device call and --runs-dir, then the variant):

    gpu6/el/zipage, gpu5/el/zipage      the AMC23 headline (the script's default trace)
    gpu7/a/zipage, gpu7/b/zipage        --trace traces/online-mixture.json
    gpu4/lb/zipage, gpu4/lb/full-kv     --trace traces/longbench.json --head 200
    gpu1/runs/full-kv-chunked           --trace traces/online-mixture.json

Every command the script runs is written to OUT/commands.txt; OUT gets the cross-trace profiles
(gzipped, times to six significant digits), the compare reports, results.json and table.md. The
simulated run directories, the attribution's profiles and reports go to --work.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from zipage.analysis.compare import compare_runs, format_report
from zipage.profile import write_profile
from zipage.sim.profile_from_runs import forward_points
from zipage.trace import Trace, load_trace, save_trace
from zipage.workloads import make_trace

REPO = Path(__file__).resolve().parent.parent
# Engine runs (H200, random Qwen3-8B, 6 GB KV, block 64, budget 512, async compression),
# relative to --runs: the runs each trace is evaluated against, and those a profile for the
# other traces is fitted from (after the compression-kernel fix where one exists).
RUNS = {
    "headline": {"evaluate": ["gpu6/el/zipage", "gpu5/el/zipage"], "fit": ["gpu6/el/zipage"]},
    "online": {"evaluate": ["gpu7/a/zipage", "gpu7/b/zipage"],
               "fit": ["gpu7/a/zipage", "gpu7/b/zipage"]},
    "longbench200": {"evaluate": ["gpu4/lb/zipage"], "fit": ["gpu4/lb/zipage"]},
}
FULL_KV = {"evaluate": "gpu4/lb/full-kv", "fit": ["gpu1/runs/full-kv-chunked"]}
DEPLOYMENT = ["--model", "qwen3-8b", "--hardware", "h200", "--kv-memory-gb", "6",
              "--block-size", "64", "--budget", "512"]
# A decode step over 10x its run's median is a mid-run compilation (the LongBench run predates
# the compression-kernel fix: five decode steps of 249-410 ms against a 7 ms median).
STALL_FACTOR = "10"
# Columns of steps.csv that are decisions (not times): a step-time replay must reproduce them.
DECISION_COLUMNS = ["kind", "n_prefill", "n_decode", "n_compress", "n_running", "n_waiting",
                    "blocks_used", "slots_used", "preempted", "prefill_tokens",
                    "decode_context_tokens", "batches_done", "attention_pairs",
                    "compress_blocks", "prefix_hit_tokens"]
SECTIONS = ("prefill", "decode", "compress")
# Uniform scalings of a profile's times for the preemption sensitivity.
SCALES = (0.97, 0.98, 0.99, 1.0, 1.01, 1.02, 1.03)


class Study:
    """The folders of one study, and the `zipage` commands it runs (each logged as typed)."""

    def __init__(self, runs: Path, out: Path, work: Path,
                 deployment: list[str] = DEPLOYMENT) -> None:
        self.runs, self.out, self.work, self.deployment = runs, out, work, deployment
        for directory in (out / "profiles", out / "compare", work):
            directory.mkdir(parents=True, exist_ok=True)
        self.commands = (out / "commands.txt").open("w")

    def zipage(self, *arguments: str) -> str:
        command = ["zipage", *arguments]
        self.commands.write(shlex.join(command) + "\n")
        self.commands.flush()
        done = subprocess.run([sys.executable, "-m", "zipage.cli", *arguments], check=True,
                              capture_output=True, text=True, cwd=REPO)
        return done.stdout

    def run(self, name: str) -> Path:
        return self.runs / name

    def fit(self, name: str, run_names: list[str], keep: bool = True) -> Path:
        """A profile from runs (stalls left out), gzipped with times to six significant
        digits, under OUT (`keep`) or --work."""
        raw = self.work / f"{name}.json"
        self.zipage("calibrate", "--from-run", *map(str, map(self.run, run_names)),
                    "--hardware", "h200", "--stall-factor", STALL_FACTOR, "--out", str(raw))
        return self.keep_profile(name, json.loads(raw.read_text()), keep)

    def keep_profile(self, name: str, profile: dict, keep: bool = True) -> Path:
        for section in ("decode", "prefill", "mixed", "compress"):
            for point in profile.get(section, []):
                # Six significant digits: rounding to the microsecond would make a batch that
                # barely outlasted its steps (behind-the-forward launches) a zero duration.
                point["time_s"] = float(f"{point['time_s']:.6g}")
        path = (self.out / "profiles" if keep else self.work) / f"{name}.json.gz"
        return write_profile(profile, path)

    def compose_full_kv(self, zipage_profile: Path, run_names: list[str]) -> Path:
        """Decode and mixed points of Full-KV runs, prefill points of a Zipage profile."""
        points = forward_points([self.run(name) for name in run_names],
                                stall_factor=float(STALL_FACTOR))
        self.commands.write(f"# Full-KV profile: forward_points({run_names}) (decode, mixed) + "
                            f"the prefill points of {zipage_profile.name}\n")
        profile = json.loads(gzip.decompress(zipage_profile.read_bytes()))
        profile.pop("compress"), profile.pop("contention_factor")
        profile["note"] = (f"decode and mixed points of {', '.join(run_names)} (Full KV), "
                           f"prefill points of {zipage_profile.name}")
        profile.update(decode=points["decode"], mixed=points["mixed"])
        return self.keep_profile("full-kv-composed", profile)

    def simulate(self, trace: Path, cost_model: str, name: str, *flags: str) -> Path:
        out = self.work / name
        self.zipage("replay", str(trace), *self.deployment, *flags, "--cost-model", cost_model,
                    "--out", str(out), "--decisions", "none", "--no-progress")
        return out

    def compare(self, sim: Path, run_name: str, label: str, keep: bool = True) -> dict:
        """`zipage compare SIM RUN`; its report under OUT (`keep`) or --work."""
        self.commands.write(shlex.join(["zipage", "compare", str(sim), str(self.run(run_name))])
                            + "\n")
        comparison = compare_runs(sim, self.run(run_name))
        folder = self.out / "compare" if keep else self.work
        (folder / f"{label}.txt").write_text(format_report(comparison))
        return row(comparison)

    def step_replay(self, trace: Path, run_name: str) -> dict:
        """The engine's decisions under its own clock: identical steps.csv decision columns."""
        out = self.work / ("step-replay-" + run_name.replace("/", "-"))
        self.zipage("replay", str(trace), "--step-times", str(self.run(run_name)), "--out",
                    str(out), "--decisions", "none", "--no-progress")
        replayed = pd.read_csv(out / "steps.csv")[DECISION_COLUMNS]
        engine = pd.read_csv(self.run(run_name) / "steps.csv")[DECISION_COLUMNS]
        same = len(replayed) == len(engine) and (replayed.values == engine.values).all()
        return {"steps": len(engine), "identical": bool(same),
                "preemptions": int(engine["preempted"].sum())}


def row(comparison: dict) -> dict:
    """The figures of one comparison that the table reports (fractions)."""
    errors = comparison["errors"]
    summary = comparison["summary"]
    by_kind = comparison["time_by_kind"]["share_of_real_time"]
    return {**{name: errors[name] for name in ("makespan", "tps", "ttft_p50", "ttft_p90",
                                               "tpot_p50", "e2e_mape")},
            "preemptions": (summary["preemptions"]["sim"], summary["preemptions"]["real"]),
            "time_by_kind": by_kind}


def traces(work: Path) -> dict[str, Path]:
    """The three traces exactly as the engine runs replayed them."""
    # bench/headline_gpu.py's default trace (its --questions 16 --samples 8 --max-output 4096).
    headline = make_trace("amc23", 0, num_questions=16, samples_per_question=8,
                          max_output_len=4096)
    # bench/headline_gpu.py --head 200: the first 200 requests, the trace's name kept.
    longbench = load_trace(REPO / "traces/longbench.json")
    paths = {"headline": work / "headline.json", "online": REPO / "traces/online-mixture.json",
             "longbench200": work / "longbench200.json"}
    save_trace(headline, paths["headline"])
    save_trace(Trace(longbench.name, longbench.requests[:200]), paths["longbench200"])
    return paths


def check_trace(trace: Path, run: Path) -> None:
    """The run replayed this trace: the same request ids, prompt and output lengths."""
    requests = load_trace(trace).requests
    measured = pd.read_csv(run / "requests.csv", dtype={"id": str})
    expected = pd.DataFrame({"id": [r.id for r in requests],
                             "prompt_len": [r.prompt_len for r in requests],
                             "output_len": [r.output_len for r in requests]})
    joined = expected.merge(measured, on="id", suffixes=("", "_run"))
    if len(joined) != len(requests) or len(measured) != len(requests) or \
            (joined["prompt_len"] != joined["prompt_len_run"]).any() or \
            (joined["output_len"] != joined["output_len_run"]).any():
        raise SystemExit(f"{run} did not replay {trace}")


def attribution(study: Study, trace: Path, name: str, cross: Path, run_name: str) -> dict:
    """Makespan and latency errors when one part of the cross-trace profile is replaced by the
    part fitted on the evaluated run itself: what each part contributes."""
    own = study.fit(f"own-{name}-{run_name.replace('/', '-')}", [run_name], keep=False)
    cross_profile, own_profile = (json.loads(gzip.decompress(path.read_bytes()))
                                  for path in (cross, own))
    results = {"cross": None, **{f"own {section}": None for section in SECTIONS}, "own all": None}
    for variant in results:
        profile = copy.deepcopy(cross_profile)
        if variant == "own all":
            profile = own_profile
        elif variant.startswith("own "):
            section = variant.split()[1]
            profile[section] = own_profile[section]
            if section == "compress":  # the batch durations come with their contention factor
                profile["contention_factor"] = own_profile["contention_factor"]
            if section == "prefill" and "mixed" in own_profile:
                profile["mixed"] = own_profile["mixed"]
        label = f"{name}-{variant.replace(' ', '-')}-{run_name.replace('/', '-')}"
        path = study.keep_profile(f"attribution-{label}", profile, keep=False)
        sim = study.simulate(trace, str(path), f"sim-{label}")
        results[variant] = study.compare(sim, run_name, f"attribution-{label}", keep=False)
    return results


def step_facts(run: Path) -> dict:
    """From one engine run's steps.csv: how its async batches ended, its host gaps, its short
    prefill steps early and late in the run, and its stalled decode steps."""
    steps = pd.read_csv(run / "steps.csv")
    duration = steps["t_end"] - steps["t_start"]
    launched = steps.index[steps["n_compress"] > 0]
    in_launching_step = int(steps.loc[launched, "batches_done"].sum())
    gaps = (steps["t_start"].shift(-1) - steps["t_end"]).dropna()
    short = (steps["kind"] == "prefill") & (steps["prefill_tokens"] < 400)
    decode = steps["kind"] == "decode"
    stalled = decode & (duration > 10 * duration[decode].median())
    return {"async_batches": len(launched), "reported_in_launching_step": in_launching_step,
            "host_gap_median_us": 1e6 * float(gaps.median()),
            "host_gaps_share": float(gaps.sum() / (steps["t_end"].max() - steps["t_start"].min())),
            "short_prefill_ms_first_10_s": 1e3 * float(duration[short & (steps["t_start"] < 10)]
                                                       .median()),
            "short_prefill_ms_second_half": 1e3 * float(
                duration[short & (steps["t_start"] > steps["t_end"].max() / 2)].median()),
            "stalled_decode_steps_ms": [round(1e3 * value, 1) for value in duration[stalled]],
            "stalled_seconds_over_median": float((duration[stalled]
                                                  - duration[decode].median()).sum())}


def longest_context_facts(trace: Path, run: Path) -> dict:
    """Decode steps against their longest context. steps.csv has only the sum of the decode
    contexts; the step-time replay makes the engine's decisions, so each of its decode plans
    holds the engine's requests, and a wrapper around the step recorder notes the longest."""
    from zipage.core import metrics
    from zipage.sim.step_replay import replay_step_times

    longest: dict[int, int] = {}
    record = metrics.MetricsRecorder.record_step

    def noting(self, plan, result):
        if plan.decode:
            longest[plan.step_id] = max(seq.kv_len for seq in plan.decode)
        record(self, plan, result)

    metrics.MetricsRecorder.record_step = noting
    try:
        replay_step_times(load_trace(trace), run)
    finally:
        metrics.MetricsRecorder.record_step = record
    steps = pd.read_csv(run / "steps.csv")
    steps["duration"] = steps["t_end"] - steps["t_start"]
    steps["longest"] = steps["step_id"].map(longest)
    plain = steps[(steps["kind"] == "decode") & (steps["n_compress"] == 0)
                  & (steps["duration"] < 0.1)]

    def relative_rms(columns: list[str]) -> tuple[float, list[float]]:
        design = np.column_stack([np.ones(len(plain))] + [plain[c] for c in columns])
        weights = plain["duration"].to_numpy()[:, None]
        solution, *_ = np.linalg.lstsq(design / weights, np.ones(len(plain)), rcond=None)
        error = design @ solution / plain["duration"].to_numpy() - 1
        return float(np.sqrt(np.mean(error ** 2))), [float(value) for value in solution]

    without, _ = relative_rms(["n_decode", "decode_context_tokens"])
    with_longest, coefficients = relative_rms(["n_decode", "decode_context_tokens", "longest"])
    buckets = pd.cut(plain["longest"], [0, 600, 2500, 5000, 10000, 20000])
    table = plain.groupby(buckets, observed=True).agg(
        steps=("duration", "size"), median_ms=("duration", "median"),
        median_batch=("n_decode", "median"))
    table["median_ms"] *= 1e3
    return {"relative_rms_sum_only": without, "relative_rms_with_longest": with_longest,
            "seconds_per_longest_token": coefficients[3],
            "by_longest_context": {str(index): row.to_dict() for index, row in table.iterrows()}}


def online_decode_ms(run: Path) -> float:
    steps = pd.read_csv(run / "steps.csv")
    plain = steps[(steps["kind"] == "decode") & (steps["n_compress"] == 0)
                  & steps["n_decode"].between(48, 56)]
    return 1e3 * float((plain["t_end"] - plain["t_start"]).median())


def first_step_ms(study: Study, profiles: Path) -> dict:
    """The headline's first step (all 128 prompts), measured and priced by the profile of the
    other traces and by the headline run's own prefill points."""
    from zipage.sim.calibrated import CalibratedCostModel

    step = pd.read_csv(study.run("gpu6/el/zipage") / "steps.csv").iloc[0]
    work = (int(step["prefill_tokens"]), int(step["attention_pairs"]), int(step["n_prefill"]))
    own = study.work / "own-headline-gpu6-el-zipage.json.gz"
    return {"measured": 1e3 * float(step["t_end"] - step["t_start"]), "prompts": work[2],
            **{name: 1e3 * CalibratedCostModel.from_profile(path).prefill_fit.predict(*work)
               for name, path in (("other traces", profiles / "fitted-without-headline.json.gz"),
                                  ("own", own))}}


def ttft_facts(run: Path) -> dict:
    """How many requests waited for memory (TTFT over 0.2 s) and the TTFT of the others."""
    requests = pd.read_csv(run / "requests.csv")
    ttft = requests["first_token"] - requests["arrival"]
    return {"queued": int((ttft > 0.2).sum()), "admitted_at_once": int((ttft <= 0.2).sum()),
            "ttft_p50_s": float(ttft.median()),
            "ttft_median_admitted_at_once_s": float(ttft[ttft <= 0.2].median()),
            "ttft_median_queued_s": float(ttft[ttft > 0.2].median())}


def sensitivity(study: Study, trace: Path, name: str, profile: Path) -> dict:
    """Preemptions and makespan of the simulated trace with every time of `profile` scaled: how
    strongly the preemption count follows the engine's speed against fixed arrivals."""
    data = json.loads(gzip.decompress(profile.read_bytes()))
    results = {}
    for scale in SCALES:
        scaled = copy.deepcopy(data)
        for section in ("decode", "prefill", "mixed", "compress"):
            for point in scaled.get(section, []):
                point["time_s"] *= scale
        path = study.keep_profile(f"scaled-{scale}-{profile.name.split('.')[0]}", scaled,
                                  keep=False)
        summary = json.loads((study.simulate(trace, str(path), f"sim-{name}-scaled-{scale}")
                              / "summary.json").read_text())
        results[str(scale)] = {"preemptions": summary["preemptions"],
                               "makespan_s": summary["makespan_s"]}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", required=True, type=Path, help="the engine runs (RUNS)")
    parser.add_argument("--out", type=Path, default=Path("runs/fidelity_cross_trace"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/zipage-fidelity"))
    args = parser.parse_args()
    study = Study(args.runs, args.out, args.work)
    paths = traces(args.work)
    for name, runs in RUNS.items():
        for run_name in runs["evaluate"]:
            check_trace(paths[name], study.run(run_name))
    check_trace(paths["longbench200"], study.run(FULL_KV["evaluate"]))
    results: dict = {"step_replay": {}, "spread": {}, "cross": {}, "analytic": {},
                     "attribution": {}, "full_kv": {}, "sensitivity": {}}
    for name, runs in RUNS.items():
        for run_name in runs["evaluate"]:
            results["step_replay"][run_name] = study.step_replay(paths[name], run_name)
        if len(runs["evaluate"]) == 2:  # the engine's own spread: one run against the other
            second, first = runs["evaluate"][1], runs["evaluate"][0]
            results["spread"][name] = study.compare(study.run(second), first,
                                                    f"spread-{name}")
    for name, runs in RUNS.items():
        others = [run for other, spec in RUNS.items() if other != name for run in spec["fit"]]
        profile = study.fit(f"fitted-without-{name}", others)
        cross = study.simulate(paths[name], str(profile), f"sim-{name}-cross")
        analytic = study.simulate(paths[name], "analytic", f"sim-{name}-analytic")
        for run_name in runs["evaluate"]:
            label = f"{name}-{run_name.replace('/', '-')}"
            results["cross"][label] = study.compare(cross, run_name, f"cross-{label}")
            results["analytic"][label] = study.compare(analytic, run_name, f"analytic-{label}")
            results["attribution"][label] = attribution(study, paths[name], name, profile,
                                                        run_name)
        if name == "online":
            results["sensitivity"][name] = sensitivity(study, paths[name], name, profile)
    # Full KV on LongBench: the only Full-KV run of another trace (the online mixture, chunked)
    # has one pure prefill step, so its decode and mixed points go with the prefill points of
    # the Zipage runs of the other traces (a prefill computes the same with compression on or
    # off); also the Zipage profile of the other traces alone, and the analytic model.
    zipage_profile = args.out / "profiles" / "fitted-without-longbench200.json.gz"
    full_kv = study.compose_full_kv(zipage_profile, FULL_KV["fit"])
    for label, cost_model in (("composed Full-KV profile", str(full_kv)),
                              ("zipage profile", str(zipage_profile)), ("analytic", "analytic")):
        sim = study.simulate(paths["longbench200"], cost_model,
                             f"sim-longbench200-full-kv-{label.split()[0].lower()}", "--no-compress")
        results["full_kv"][label] = study.compare(sim, FULL_KV["evaluate"],
                                                  f"full-kv-longbench200-{label.split()[0].lower()}")
    results["facts"] = {
        "steps": {run: step_facts(study.run(run)) for spec in RUNS.values()
                  for run in spec["evaluate"]},
        "longbench200_decode": longest_context_facts(paths["longbench200"],
                                                     study.run("gpu4/lb/zipage")),
        "online_decode_batch_48_56_median_ms": online_decode_ms(study.run("gpu7/a/zipage")),
        "ttft": {**{run: ttft_facts(study.run(run)) for run in RUNS["online"]["evaluate"]},
                 "simulated (cross)": ttft_facts(args.work / "sim-online-cross")},
        "headline_first_step_ms": first_step_ms(study, args.out / "profiles"),
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "table.md").write_text(table(results))
    print(table(results))


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f} %"


def table_row(label: str, model: str, figures: dict) -> str:
    errors = " | ".join(percent(figures[name]) for name in ("makespan", "tps", "ttft_p50",
                                                           "ttft_p90", "tpot_p50"))
    simulated, measured = figures["preemptions"]
    return (f"| {label} | {model} | {errors} | {100 * figures['e2e_mape']:.1f} % | "
            f"{simulated} / {measured} |")


def table(results: dict) -> str:
    lines = ["| trace, engine run | model | makespan | TPS | TTFT p50 | TTFT p90 | TPOT p50 | "
             "e2e MAPE | preemptions sim / engine |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [table_row(label, "engine run 2 against run 1", figures)
              for label, figures in results["spread"].items()]
    for kind in ("cross", "analytic"):
        lines += [table_row(label, kind, figures) for label, figures in results[kind].items()]
    lines += [table_row("longbench200 Full KV", label, figures)
              for label, figures in results["full_kv"].items()]
    lines += ["", "makespan / TTFT p50 / e2e MAPE with one part of the profile fitted on the "
                  "evaluated run itself:", "",
              "| trace, engine run | cross | own prefill | own decode | own compress | own all |",
              "|---|---|---|---|---|---|"]
    for label, variants in results["attribution"].items():
        lines.append(f"| {label} | " + " | ".join(
            f"{percent(figures['makespan'])} / {percent(figures['ttft_p50'])} / "
            f"{100 * figures['e2e_mape']:.1f} %" for figures in variants.values()) + " |")
    for name, scaled in results["sensitivity"].items():
        lines += ["", f"{name}, every time of the cross-trace profile scaled: preemptions "
                      "(makespan s): " + ", ".join(
                          f"x{scale} {figures['preemptions']} ({figures['makespan_s']:.2f})"
                          for scale, figures in scaled.items())]
    lines += ["", "step-time replay: " + ", ".join(
        f"{run} {'identical' if check['identical'] else 'DIFFERENT'} "
        f"({check['steps']} steps, {check['preemptions']} preemptions)"
        for run, check in results["step_replay"].items())]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
