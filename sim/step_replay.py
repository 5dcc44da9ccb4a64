"""Step-time replay: drive the core with an engine run's measured clock instead of a cost model.

`zipage replay TRACE --step-times RUN_DIR` reads the run directory an engine replay or a served
run wrote (`--out`): its capacity and knobs (summary.json), the start and end of every step and
which async compression batch each step's result reported done (steps.csv), and the number of
tokens each request produced (requests.csv). It then runs the trace through the same core with
exactly those times: a request is added once the replayed clock reaches its arrival (the engine
adds it at the start of the first step that begins after it arrives), each step lasts what the
engine measured, and each async batch completes in the step that reported it.

With the clock taken from the engine, any difference left between the two runs is a difference in
*decisions* — scheduling drift, which must be zero — not cost-model error. The summary says
whether the decision logs agree step for step (`decisions_match`) and where they first differ.
"""

from __future__ import annotations

from pathlib import Path

from zipage.core.arrivals import ArrivalQueue
from zipage.core.deployment import ReplaySettings, effective_config, trace_sequences
from zipage.core.recorder import Run, StepRecorder
from zipage.core.scheduler import Scheduler
from zipage.core.step import StepResult
from zipage.errors import ZipageError
from zipage.model_spec import resolve_shape
from zipage.trace import Trace

STEP_TIME_COLUMNS = ("step_id", "t_start", "t_end", "batches_done")


def replay_step_times(trace: Trace, run_dir: str | Path, *, check: bool = False,
                      progress: bool = False) -> tuple[dict, Run]:
    run_dir = Path(run_dir)
    summary, steps, produced, engine_log = _read_run(run_dir)
    settings = ReplaySettings.from_dict(summary["settings"])
    shape = resolve_shape(settings.model)
    config = effective_config(settings, shape)
    # The engine's own capacity: it may have planned from the GPU it ran on, not a table entry.
    scheduler = Scheduler(config, summary["num_blocks"], summary.get("max_concurrency") or 0,
                          summary.get("num_host_blocks") or 0)
    sequences = trace_sequences(trace, shape.vocab_size, need_tokens=False, scheduler=scheduler,
                                block_keys=True)
    for seq in sequences:
        # Requests the engine stopped early (EOS) end at the same token here.
        seq.max_output_tokens = produced.get(seq.seq_id, seq.max_output_tokens)
    recorder = StepRecorder(scheduler, check=check, log_decisions=True, progress=progress,
                            total=len(sequences))
    arrivals = ArrivalQueue(sequences, users=settings.users)
    recorder.follow(arrivals)
    in_flight: int | None = None
    for step in steps.itertuples(index=False):
        arrivals.admit_due(recorder, step.t_start)
        plan = recorder.schedule()
        if plan is None:  # the engine ran more steps than the replay needs: drift
            break
        if plan.compress_launch is not None:
            in_flight = plan.compress_launch.batch_id
        completed = []
        if step.batches_done and in_flight is not None:
            completed, in_flight = [in_flight], None
        recorder.finish(plan, StepResult(step_id=plan.step_id, t_start=float(step.t_start),
                                         t_end=float(step.t_end), completed_batches=completed))
    run = recorder.result()
    # Steps the engine ran and the replay did not (or the reverse) are drift too.
    unfinished = scheduler.has_unfinished() or arrivals.has_pending
    first = _first_difference(engine_log, run.decision_log)
    run.summary.update(
        driver="step-replay", device=f"clock of {summary.get('device', 'the engine')}",
        num_blocks=summary["num_blocks"],
        max_concurrency=summary.get("max_concurrency"), n_max=summary.get("n_max"),
        settings=summary["settings"], engine_steps=len(steps),
        decisions_compared=bool(engine_log),
        decisions_match=bool(engine_log) and first is None and not unfinished,
        first_decision_difference=first)
    return run.summary, run


def _read_run(run_dir: Path):
    from zipage.rundir import ENGINE, load_run, read_decisions, read_summary, run_kind

    flag = "--step-times"
    summary = read_summary(run_dir, flag)
    if run_kind(summary) != ENGINE:
        raise ZipageError(f"{flag} {run_dir}: a {summary.get('driver', run_kind(summary))} run "
                          "has no engine steps to replay; give an engine run (`zipage replay "
                          "--gpu --out DIR`)")
    run = load_run(run_dir, flag, summary)
    steps, requests = run.steps, run.requests
    missing = [column for column in STEP_TIME_COLUMNS if column not in steps.columns]
    if missing or "config" not in summary.get("settings", {}) or "num_blocks" not in summary:
        raise ZipageError(f"{flag} {run_dir}: not a run directory of this version (missing "
                          f"{', '.join(missing) or 'settings'}); rerun the engine with --out")
    done = requests[requests["status"] == "finished"]
    produced = dict(zip(done["id"], done["output_len"].astype(int)))
    return summary, steps, produced, read_decisions(run_dir, summary, flag) or []


def _first_difference(engine: list[str], replayed: list[str]) -> dict | None:
    for index, (ours, theirs) in enumerate(zip(replayed, engine)):
        if ours != theirs:
            return {"step": index, "engine": theirs[:200], "replay": ours[:200]}
    if len(engine) != len(replayed):
        index = min(len(engine), len(replayed))
        return {"step": index, "engine": (engine[index:] or ["(no step)"])[0][:200],
                "replay": (replayed[index:] or ["(no step)"])[0][:200]}
    return None
