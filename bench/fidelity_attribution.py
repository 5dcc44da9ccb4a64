"""Where the twin's remaining misses come from, step by step (issue #15; docs/BENCHMARKS.md,
'Twin fidelity', "What is left, and why"): 0.6B online TPOT p50 (Zipage, Full KV), 0.6B LongBench
(Zipage, Full KV), 8B Zipage LongBench. Each engine step (steps.csv) is priced with the matrix's
cross-trace profile (fitted on the other two traces), the simulator's rules replayed on the
engine's own step sequence (`price`). It prints:

1. TPOT p50: the engine's; the error when each request's life is re-summed with predicted step
   times on the engine's schedule; the simulation's error; steps per output token.
2. The error by step group (Zipage: 0.6B online and LongBench, 8B LongBench), with the group's share of
   a median request's life (40th-60th TPOT percentile) and the TPOT error it gives (pp).
3. The same by decode batch and mean context (0.6B Full KV online and LongBench).
4. Shared prefix entries of decode steps (a block held by k decode requests is summed k times in
   `decode_context_tokens`), from each run's step-time replay: steps.csv lacks them. Then the
   Full-KV decode plane refitted with context summed or distinct.

    python bench/fidelity_attribution.py --runs RUNS [--profiles runs/fidelity_matrix/profiles]

RUNS is laid out as for bench/fidelity_matrix.py, whose docstring says how to make the runs on a
GPU; the profiles are those it writes under its --out. About 20 s on two cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from collections import Counter
from pathlib import Path
from unittest import mock

import numpy as np
import pandas as pd
from fidelity_cross_trace import DECISION_COLUMNS, traces
from fidelity_matrix import RUNS, deployment

from zipage.cli.flags import add_engine_flags, settings_from_args
from zipage.core.recorder import StepRecorder
from zipage.sim import step_replay
from zipage.sim.calibrated import CalibratedCostModel
from zipage.sim.cost_model import StepWork
from zipage.sim.linear_fit import fit_linear
from zipage.sim.simulate import simulate
from zipage.trace import load_trace

PROFILES = Path("runs/fidelity_matrix/profiles")  # bench/fidelity_matrix.py's default --out
CASES = [("qwen3-0.6b", "zipage", "online"), ("qwen3-0.6b", "zipage", "longbench200"),
         ("qwen3-0.6b", "full-kv", "online"), ("qwen3-0.6b", "full-kv", "longbench200"),
         ("qwen3-8b", "zipage", "longbench200")]
BLOCK_SIZE = 64  # fidelity_matrix.deployment's --block-size
BATCH_BINS, CONTEXT_BINS = [0, 8, 16, 32, 64, 128, 256, 600], [0, 500, 1000, 2000, 4000, 8000, 1e6]


def engine_run(directory: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    steps = pd.read_csv(directory / "steps.csv")
    steps["dur"] = steps.t_end - steps.t_start
    steps["gap"] = (steps.t_start.shift(-1) - steps.t_end).fillna(0.0)
    # A simulated step lasts until the next one starts: compare with the span plus the host gap.
    steps["measured"] = steps.dur + steps.gap
    return steps, pd.read_csv(directory / "requests.csv", dtype={"id": str})


def price(model: CalibratedCostModel, steps: pd.DataFrame) -> pd.DataFrame:
    """The simulator's rules on the engine's steps: the profile prices each forward, stretched by
    contention while a predicted compression batch is in flight. A batch starts behind its
    launching step's forward (the runs compress asynchronously); an idle step waits for it."""
    predicted, overlapped = np.zeros(len(steps)), np.zeros(len(steps), bool)
    now = batch_end = 0.0
    for i, step in enumerate(steps.itertuples(index=False)):
        if step.kind == "idle":
            duration = max(batch_end - now, 0.0)
        else:
            duration = model.forward_time_for(StepWork(
                step.n_decode, step.decode_context_tokens, num_prefill=step.n_prefill,
                prefill_tokens=step.prefill_tokens, attention_pairs=step.attention_pairs,
                decode_max_context=step.decode_max_context))
            overlapped[i] = batch_end > now
            if overlapped[i]:
                duration *= model.decode_contention((batch_end - now) / duration)
        if step.n_compress:
            batch_end = now + duration + model.compress_time_for([step.compress_blocks])
        predicted[i] = duration
        now += duration
    return steps.assign(predicted=predicted, overlapped=overlapped)


def lifetimes(requests: pd.DataFrame, steps: pd.DataFrame, values) -> tuple[np.ndarray, ...]:
    """Per request: the sum of `values` over the steps of its life, and their number."""
    total = np.concatenate([[0.0], np.cumsum(values)])
    first = np.searchsorted(steps.t_start.to_numpy(), requests.first_token.to_numpy() - 1e-9)
    last = np.searchsorted(steps.t_end.to_numpy(), requests.finish.to_numpy() + 1e-9)
    return total[last] - total[first], last - first


def decoding(requests: pd.DataFrame) -> tuple[pd.DataFrame, pd.Series, pd.Series]:
    """The requests that have a TPOT (more than one output token), their life and TPOT."""
    requests = requests[requests.output_len > 1]
    life = requests.finish - requests.first_token
    return requests, life, life / (requests.output_len - 1)


def simulation(model: str, mode: str, trace: Path, profile: Path):
    """`zipage replay TRACE --cost-model PROFILE` with the matrix's deployment, in process."""
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    flags = deployment(model, mode) + ["--cost-model", str(profile)]
    _, run = simulate(load_trace(trace), settings_from_args(parser.parse_args(flags)))
    requests = pd.DataFrame(map(dataclasses.asdict, run.requests)).set_index("id")
    return pd.DataFrame(map(dataclasses.asdict, run.steps)), requests


def summary_row(steps, requests, sim_steps, sim_requests) -> dict:
    requests, life, engine = decoding(requests)
    measured, engine_steps = lifetimes(requests, steps, steps.measured)
    predicted, _ = lifetimes(requests, steps, steps.predicted)
    fixed = (life + predicted - measured) / (requests.output_len - 1)
    sim, _, simulated = decoding(sim_requests.loc[requests.id])
    _, sim_step_count = lifetimes(sim, sim_steps, np.zeros(len(sim_steps)))
    return {"TPOT p50 engine ms": 1e3 * engine.median(),
            "on the engine's schedule %": 100 * (fixed.median() / engine.median() - 1),
            "simulation %": 100 * (simulated.median() / engine.median() - 1),
            "steps/token engine": np.median(engine_steps / (requests.output_len - 1)),
            "steps/token sim": np.median(sim_step_count / (sim.output_len - 1))}


def group_table(steps: pd.DataFrame, keys: list[str], requests: pd.DataFrame) -> pd.DataFrame:
    """Per group of steps (a key of NaN: none): n, mean measured and predicted ms, error, share
    of the makespan; share of a median request's life and the TPOT error (pp) it gets."""
    requests, life, tpot = decoding(requests)
    mid = tpot.between(*tpot.quantile([0.4, 0.6]))
    requests, life = requests[mid], life[mid].to_numpy()
    # A step's own error with the host gap at its median; the gaps' deviation is a row of its own.
    step_error = steps.predicted - steps.dur - steps.gap.median()
    in_life = lambda mask, values: 100 * np.mean(
        lifetimes(requests, steps, np.where(mask, values, 0.0))[0] / life)
    rows, makespan = [], steps.measured.sum()
    for key, group in steps.groupby(keys, observed=True, dropna=False):
        mask, measured, predicted = steps.index.isin(group.index), group.measured, group.predicted
        rows.append({**dict(zip(keys, key)), "n": len(group), "measured ms": 1e3 * measured.mean(),
                     "predicted ms": 1e3 * predicted.mean(),
                     "error %": 100 * (predicted.sum() / measured.sum() - 1),
                     "of makespan %": 100 * (predicted.sum() - measured.sum()) / makespan,
                     "of life %": in_life(mask, steps.measured),
                     "TPOT pp": in_life(mask, step_error)})
    rows.append({keys[0]: "host-gap deviation",
                 "TPOT pp": in_life(True, steps.gap.median() - steps.gap)})
    return pd.DataFrame(rows).astype({"n": "Int64"})


def step_groups(steps: pd.DataFrame) -> pd.DataFrame:
    """Steps by kind, by whether they launch a compression batch and whether they run beside one
    (a predicted batch in flight: "overlapped")."""
    decode, launch, beside = steps.kind == "decode", steps.n_compress > 0, steps.overlapped
    return steps.assign(group=np.select(
        [decode & launch & beside, decode & launch, decode & beside, decode, beside],
        ["decode launching, overlapped", "decode launching a batch", "decode overlapped",
         "decode", steps.kind + " overlapped"], default=steps.kind))


def decode_bins(steps: pd.DataFrame) -> pd.DataFrame:
    """Decode steps by batch and mean context bins (named 1-8, ..., >8000), others by kind."""
    binned = lambda values, edges: pd.cut(values, edges, labels=[
        f"{low + 1:g}-{high:g}" for low, high in zip(edges, edges[1:-1])] + [f">{edges[-2]:g}"])
    decode = steps.kind == "decode"
    batch = binned(steps.n_decode.where(decode), BATCH_BINS)
    context = binned((steps.decode_context_tokens / steps.n_decode).where(decode), CONTEXT_BINS)
    batch = batch.cat.add_categories(list(steps.kind.unique())).fillna(steps.kind)
    return steps.assign(**{"batch or kind": batch, "mean context": context})


def shared_entries(trace: Path, directory: Path) -> pd.DataFrame:
    """An engine run's steps with each decode step's shared entries and longest context, from
    its step-time replay (checked to make the engine's decisions, column by column)."""
    steps, shared = engine_run(directory)[0], {}

    class Noting(StepRecorder):
        # replay_step_times builds its own recorder; this one reads the plan's block tables as
        # the forward sees them (after the step, finished requests have let theirs go).
        def schedule(self):
            plan = super().schedule()
            if plan is not None and plan.decode:
                held = Counter(block for seq in plan.decode for block in seq.block_table)
                shared[plan.step_id] = BLOCK_SIZE * sum(k - 1 for k in held.values())
            return plan

    with mock.patch.object(step_replay, "StepRecorder", Noting):
        _, run = step_replay.replay_step_times(load_trace(trace), directory)
    replayed = pd.DataFrame(map(dataclasses.asdict, run.steps))
    if len(replayed) != len(steps) or \
            (replayed[DECISION_COLUMNS].values != steps[DECISION_COLUMNS].values).any():
        raise SystemExit(f"the step-time replay of {directory} made other decisions")
    # The headline runs predate steps.csv's decode_max_context: it comes from the replay.
    return steps.assign(shared=replayed.step_id.map(shared).fillna(0).to_numpy(),
                        decode_max_context=replayed.decode_max_context.to_numpy())


def decode_points(steps: pd.DataFrame) -> pd.DataFrame:
    """Decode points as `zipage calibrate --from-run` takes them (host gap at its median), with
    the longest request's excess and the distinct context."""
    points = steps[(steps.kind == "decode") & (steps.n_compress == 0)]
    return points.assign(time_s=points.dur + steps.gap.median(),
                         excess=(points.decode_max_context - points.decode_context_tokens
                                 / points.n_decode).clip(lower=0),
                         distinct=points.decode_context_tokens - points.shared)


def refit_error(fit_on: pd.DataFrame, target: pd.DataFrame, context: str) -> float:
    """Decode-sum error on `target` of a + b batch + c context + d excess fitted on `fit_on`, in
    relative least squares as the profiles are."""
    columns = ["n_decode", context, "excess"]
    fit = fit_linear("refit", "decode", ("batch", "context", "excess"), fit_on[columns].values.tolist(),
                     fit_on.time_s.tolist())
    predicted = fit.coefficients[0] + target[columns].values @ np.array(fit.coefficients[1:])
    return 100 * (predicted.sum() / target.time_s.sum() - 1)


def shared_tables(runs: Path, paths: dict) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every Full-KV run and the 8B LongBench Zipage runs: shared share; the refits."""
    shares, refits = [], []
    for model in RUNS:
        points = {}
        for trace, modes in RUNS[model].items():
            extra = modes["zipage"] if (model, trace) == ("qwen3-8b", "longbench200") else []
            for run in modes["full-kv"] + extra:
                steps = shared_entries(paths[trace], runs / run)
                decode = steps[steps.kind == "decode"]
                context = decode.decode_context_tokens
                shares.append({"model": model, "trace": trace, "run": run,
                               "shared / context %": 100 * decode.shared.sum() / context.sum(),
                               "context / held KV (median)":
                               (context / (decode.blocks_used * BLOCK_SIZE)).median()})
                if run not in extra:
                    points.setdefault(trace, []).append(decode_points(steps))
        for target in points:
            fit_on = pd.concat([p for trace in points if trace != target for p in points[trace]])
            evaluated = pd.concat(points[target])
            refits.append({"model": model, "target (Full KV)": target,
                           "context as summed %": refit_error(fit_on, evaluated,
                                                              "decode_context_tokens"),
                           "as distinct entries %": refit_error(fit_on, evaluated, "distinct")})
    return pd.DataFrame(shares), pd.DataFrame(refits)


def show(title: str, table: pd.DataFrame, digits: int = 2) -> None:
    """A markdown table, floats to `digits` decimals."""
    cell = lambda v: ("" if pd.isna(v) else f"{v:,.{digits}f}" if isinstance(v, float)
                      else f"{v:,}" if isinstance(v, (int, np.integer)) else str(v))
    print(f"\n{title}\n\n| " + " | ".join(table.columns) + " |\n|" + "---|" * len(table.columns))
    for row in table.itertuples(index=False):
        print("| " + " | ".join(map(cell, row)) + " |")


def print_step_tables(priced: dict) -> None:
    for model, trace in (("qwen3-0.6b", "online"), ("qwen3-0.6b", "longbench200"),
                         ("qwen3-8b", "longbench200")):
        for name in "ab":
            steps, requests = priced[model, "zipage", trace, name]
            show(f"{model} Zipage {trace} {name} by step group ({steps.measured.sum():.2f} s "
                 f"measured, {steps.predicted.sum():.2f} s predicted)",
                 group_table(step_groups(steps), ["group"], requests))
    for trace in ("online", "longbench200"):
        for name in "ab":
            steps, requests = priced["qwen3-0.6b", "full-kv", trace, name]
            decode, steps = steps[steps.kind == "decode"], decode_bins(steps)
            title = f"qwen3-0.6b Full KV {trace} {name}"
            show(f"{title} by decode batch and mean context (decode: {decode.measured.sum():.1f}"
                 f" s measured, {decode.predicted.sum():.1f} s predicted, "
                 f"{100 * decode.measured.sum() / steps.measured.sum():.0f} % of the run)",
                 group_table(steps, ["batch or kind", "mean context"], requests))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", required=True, type=Path, help="the engine runs (RUNS)")
    parser.add_argument("--profiles", type=Path, default=PROFILES,
                        help="the matrix's cross-trace profiles (fitted-MODEL-MODE-without-TRACE)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        paths = traces(Path(work))  # the traces exactly as the engine runs replayed them
        summary, priced = [], {}
        for model, mode, trace in CASES:
            profile = args.profiles / f"fitted-{model}-{mode}-without-{trace}.json.gz"
            cost_model = CalibratedCostModel.from_profile(profile)
            sim = simulation(model, mode, paths[trace], profile)
            for name, run in zip("ab", RUNS[model][trace][mode]):
                steps, requests = engine_run(args.runs / run)
                priced[model, mode, trace, name] = price(cost_model, steps), requests
                summary.append({"case": f"{model} {mode} {trace} {name}",
                                **summary_row(*priced[model, mode, trace, name], *sim)})
        show("TPOT p50 error on the engine's schedule and in the simulation",
             pd.DataFrame(summary), 3)
        print_step_tables(priced)
        shares, refits = shared_tables(args.runs, paths)
    show("Shared prefix entries in decode steps (step-time replay)", shares)
    show("Full-KV decode plane refitted on the other traces: decode-sum error", refits, 1)


if __name__ == "__main__":
    main()
