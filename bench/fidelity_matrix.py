"""Twin fidelity over traces x models x modes (issue #15; docs/BENCHMARKS.md, 'Twin fidelity').

Three traces (the AMC23 headline: offline reasoning; the online mixture: arrivals, long and short
prompts; the first 200 requests of the LongBench-shaped trace: long prompts sharing prefixes),
Qwen3-8B and Qwen3-0.6B, Zipage and Full KV, two engine runs each (H200, bench/fidelity_runs.sh).
For every (model, mode, trace) a profile is fitted on the runs of the *other two* traces of the
same model and mode (`zipage calibrate --from-run`), the trace is simulated with it and with the
analytic model, and both are compared with each engine run (`zipage compare`); the second engine
run is compared with the first, the same way (the engine's spread).

Runs written before steps.csv had `decode_max_context` get the column from their step-time replay:
`zipage replay TRACE --step-times RUN` makes the engine's
decisions step for step (checked here, column by column, for every run), so its plans hold the
engine's decode requests. The completed copies go to --work/runs; the originals are not touched.

    python bench/fidelity_matrix.py --runs RUNS [--out runs/fidelity_matrix]

RUNS are engine runs, made on an H200 (one device call per part, each under 10 minutes) and
unpacked into one folder; the layout is `model_runs` below:

    . bench/env.sh && bash bench/fidelity_runs.sh PART $OUT    # PART: 8b-headline, 8b-online,
                                                               # 8b-longbench, 06-headline, 06
    for f in OUT/*.tar.gz; do tar -xzf $f -C RUNS; done

Every `zipage` command it runs is written to OUT/commands.txt; OUT gets the cross-trace profiles
(which bench/fidelity_attribution.py reads), the compare reports, results.json and table.md.
The results.json of the documented table is docs/results/bench/fidelity-matrix.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pandas as pd
from fidelity_cross_trace import DECISION_COLUMNS, Study, check_trace, traces


def model_runs(tag: str) -> dict:
    """One model's runs, relative to --runs, as bench/fidelity_runs.sh names them; `tag` names
    the model (8b, 06). a, b: two runs of one trace (the engine's spread)."""
    return {
        "headline": {"zipage": [f"{tag}-headline-{run}/runs/zipage" for run in "ab"],
                     "full-kv": [f"{tag}-headline-a/runs/full-kv",
                                 f"{tag}-headline-fullkv/runs/full-kv"]},
        **{trace: {mode: [f"{tag}-{short}-{run}/runs/{mode}" for run in "ab"]
                   for mode in ("zipage", "full-kv")}
           for trace, short in (("online", "online"), ("longbench200", "lb"))},
    }


RUNS = {"qwen3-8b": model_runs("8b"), "qwen3-0.6b": model_runs("06")}
KV_MEMORY_GB = {"qwen3-8b": "6", "qwen3-0.6b": "3"}
TARGETS = {"makespan": 0.03, "tps": 0.03, "ttft_p50": 0.10, "ttft_p90": 0.10, "tpot_p50": 0.05,
           "e2e_mape": 0.08}
METRICS = tuple(TARGETS)


def deployment(model: str, mode: str) -> list[str]:
    flags = ["--model", model, "--hardware", "h200", "--kv-memory-gb", KV_MEMORY_GB[model],
             "--block-size", "64", "--budget", "512"]
    return flags + (["--no-compress"] if mode == "full-kv" else [])


def label(*parts: str) -> str:
    return "-".join(part.replace("/", "-") for part in parts)


def complete_run(study: Study, trace: Path, source: Path, name: str) -> dict:
    """Copy a run under --work/runs with `decode_max_context` from its step-time replay, after
    checking that the replay made the engine's decisions."""
    replay = study.work / f"step-replay-{name}"
    study.zipage("replay", str(trace), "--step-times", str(source), "--out", str(replay),
                 "--decisions", "none", "--no-progress")
    replayed, engine = pd.read_csv(replay / "steps.csv"), pd.read_csv(source / "steps.csv")
    same = len(replayed) == len(engine) and bool(
        (replayed[DECISION_COLUMNS].values == engine[DECISION_COLUMNS].values).all())
    if not same:
        raise SystemExit(f"the step-time replay of {source} made other decisions")
    target = study.runs / name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)
    had = "decode_max_context" in engine and bool(engine["decode_max_context"].any())
    if had:
        if not (engine["decode_max_context"] == replayed["decode_max_context"]).all():
            raise SystemExit(f"{source}: the replay's longest decode contexts differ")
    else:
        engine["decode_max_context"] = replayed["decode_max_context"]
        engine.to_csv(target / "steps.csv", index=False)
    return {"steps": len(engine), "identical_decisions": same,
            "preemptions": int(engine["preempted"].sum()),
            "decode_max_context": "engine" if had else "step-time replay"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", required=True, type=Path, help="the engine runs (RUNS)")
    parser.add_argument("--out", type=Path, default=Path("runs/fidelity_matrix"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/zipage-fidelity-matrix"))
    parser.add_argument("--models", default=",".join(RUNS))
    args = parser.parse_args()
    (args.work / "runs").mkdir(parents=True, exist_ok=True)
    study = Study(args.work / "runs", args.out, args.work)
    paths = traces(args.work)
    results: dict = {"step_replay": {}, "rows": []}
    for model in args.models.split(","):
        for trace, modes in RUNS[model].items():
            for mode, runs in modes.items():
                for run in runs:
                    check_trace(paths[trace], args.runs / run)
                    results["step_replay"][run] = complete_run(
                        study, paths[trace], args.runs / run, label(model, trace, mode, run))
        for mode in ("zipage", "full-kv"):
            study.deployment = deployment(model, mode)
            for trace in RUNS[model]:
                names = [label(model, trace, mode, run) for run in RUNS[model][trace][mode]]
                spread = study.compare(study.run(names[1]), names[0],
                                       label("spread", model, trace, mode))
                results["rows"].append({"model": model, "mode": mode, "trace": trace,
                                        "model_kind": "engine spread", "run": "b vs a",
                                        **spread})
                others = [label(model, other, mode, run) for other in RUNS[model]
                          if other != trace for run in RUNS[model][other][mode]]
                profile = study.fit(label("fitted", model, mode, "without", trace), others)
                for kind, cost_model in (("profile of the others", str(profile)),
                                         ("analytic", "analytic")):
                    tag = "cross" if kind.startswith("profile") else "analytic"
                    sim = study.simulate(paths[trace], cost_model, label("sim", model, mode,
                                                                         trace, tag))
                    for run, name in zip("ab", names):
                        figures = study.compare(sim, name, label(tag, model, mode, trace, run))
                        results["rows"].append({"model": model, "mode": mode, "trace": trace,
                                                "model_kind": kind, "run": run, **figures})
                print(table(results["rows"][-5:]), flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "table.md").write_text(table(results["rows"]))
    print(table(results["rows"]))


def cell(name: str, value: float | None, kind: str) -> str:
    if value is None:
        return "-"
    text = f"{100 * value:.1f} %" if name == "e2e_mape" else f"{100 * value:+.1f} %"
    met = kind != "engine spread" and abs(value) <= TARGETS[name]
    return f"**{text}**" if met else text


def table(rows: list[dict]) -> str:
    lines = ["| model | mode | trace | model | run | makespan | TPS | TTFT p50 | TTFT p90 | "
             "TPOT p50 | e2e MAPE | preemptions sim / engine |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for item in rows:
        simulated, measured = item["preemptions"]
        figures = " | ".join(cell(name, item[name], item["model_kind"]) for name in METRICS)
        lines.append(f"| {item['model']} | {item['mode']} | {item['trace']} | "
                     f"{item['model_kind']} | {item['run']} | {figures} | "
                     f"{simulated} / {measured} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
