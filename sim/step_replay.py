"""Step-time replay: drive the core with an engine run's measured clock instead of a cost model.

`zipage replay TRACE --step-times RUN_DIR` reads the run directory an engine replay or a served
run wrote (`--out`): its capacity and knobs (summary.json), the start and end of every step and
which async compression batch each step's result reported done (steps.csv), and the number of
tokens each request produced (requests.csv). It then runs the trace through the same core with
exactly those times: a request is added once the replayed clock reaches its arrival (the engine
adds it when it plans the first step after it arrives: `planned_at`), each step lasts what the
engine measured, and each async batch completes in the step that reported it. A run made with
async scheduling is replayed in its interleaving (each step planned before the one before it
settled, `planned_early` and `settled_late`), its EOS stops seen one step late as the engine saw
them.

With the clock taken from the engine, any difference left between the two runs is a difference in
*decisions* — scheduling drift, which must be zero — not cost-model error. The summary says
whether the decision logs agree step for step (`decisions_match`) and where they first differ.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

from zipage.core.arrivals import ArrivalQueue
from zipage.core.deployment import ReplaySettings, effective_config, trace_sequences
from zipage.core.recorder import Run, StepRecorder
from zipage.core.scheduler import Scheduler
from zipage.core.step import StepResult
from zipage.errors import ZipageError
from zipage.model_spec import resolve_shape
from zipage.sim.instant import reached_stops
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
    run, drifted = replay_steps(scheduler, sequences, steps.itertuples(index=False), produced,
                                users=settings.users, check=check, progress=progress)
    first = _first_difference(engine_log, run.decision_log)
    run.summary.update(
        driver="step-replay", device=f"clock of {summary.get('device', 'the engine')}",
        num_blocks=summary["num_blocks"],
        max_concurrency=summary.get("max_concurrency"), n_max=summary.get("n_max"),
        settings=summary["settings"], engine_steps=len(steps),
        decisions_compared=bool(engine_log),
        decisions_match=bool(engine_log) and first is None and not drifted,
        first_decision_difference=first)
    return run.summary, run


class _Interleaving:
    """The engine's steps applied in its order. Synchronously each is planned and finished in
    turn. Under async scheduling (docs/architecture.md, 'Async scheduling') a step recorded
    `settled_late` is settled after the next plan, as the engine's loop did; `planned_early`
    says whether a step was planned while the one before still ran, so a step before it that
    is still unsettled was settled by an iteration that planned nothing."""

    def __init__(self, recorder: StepRecorder, stops: dict[str, int],
                 asynchronous: bool) -> None:
        self.recorder = recorder
        self.asynchronous = asynchronous
        self.stops = stops
        self.running = None  # a step to settle late: (plan, its steps.csv row)
        self.in_flight: int | None = None  # the async compression batch not yet reported
        self.drifted = False

    def step(self, arrivals: ArrivalQueue, step) -> bool:
        recorder = self.recorder
        if self.running is not None and not step.planned_early:
            if not self._settle_idle():
                return False
        planned_at = float(step.planned_at) if step.planned_at >= 0 else float(step.t_start)
        arrivals.admit_due(recorder, planned_at)
        running, self.running = self.running, None
        if running is not None:
            recorder.advance()
        plan = recorder.schedule()
        if plan is None:
            return False
        if plan.compress_launch is not None:
            self.in_flight = plan.compress_launch.batch_id
        if running is not None:
            self._apply(*running, settle=True)
        if step.settled_late:
            self.running = (plan, step)
        elif self.asynchronous:  # run synchronously by the async loop: advanced, then settled
            recorder.advance()
            self._apply(plan, step, settle=True)
        else:
            self._apply(plan, step, settle=False)
        return True

    def drain(self, arrivals: ArrivalQueue) -> None:
        """After the engine's last step: that step settled, and any request arriving later
        added, each to be rejected (nothing is left to plan)."""
        if self.running is not None and not self._settle_idle():
            return
        arrivals.admit_due(self.recorder, math.inf)
        if self.recorder.schedule() is not None:
            self.drifted = True

    def _settle_idle(self) -> bool:
        """An iteration that planned nothing and settled the step that ran."""
        running, self.running = self.running, None
        self.recorder.advance()
        if self.recorder.schedule() is not None:  # the engine planned nothing here: drift
            self.drifted = True
            return False
        self._apply(*running, settle=True)
        return True

    def _apply(self, plan, step, settle: bool) -> None:
        completed = []
        if step.batches_done and self.in_flight is not None:
            completed, self.in_flight = [self.in_flight], None
        result = StepResult(step_id=plan.step_id, t_start=float(step.t_start),
                            t_end=float(step.t_end), completed_batches=completed)
        if not settle:
            self.recorder.finish(plan, result)
            return
        if self.stops:  # (the engine's stops: requests that sampled their EOS in this step)
            result.stopped = reached_stops(plan, self.stops)
        self.recorder.settle(plan, result)


def replay_steps(scheduler: Scheduler, sequences: list, steps: Iterable, produced: dict[str, int],
                 *, users: int | None = None, check: bool = False,
                 progress: bool = False) -> tuple[Run, bool]:
    """`sequences` through `scheduler` on a run's steps (rows with steps.csv's columns), each
    request ending after the tokens it `produced` there; returns the run and whether it drifted
    (more steps, fewer, or requests left over)."""
    asynchronous = bool(scheduler.config.async_scheduling)
    stops = {}  # request id -> the output token the engine sampled its EOS at (async)
    for seq in sequences:
        done = produced.get(seq.seq_id, seq.max_output_tokens)
        if not asynchronous:  # a stop and a length finish are one decision when synchronous
            seq.max_output_tokens = done
        elif done < seq.max_output_tokens:
            stops[seq.seq_id] = done
    recorder = StepRecorder(scheduler, check=check, log_decisions=True, progress=progress,
                            total=len(sequences))
    arrivals = ArrivalQueue(sequences, users=users)
    recorder.follow(arrivals)
    replay = _Interleaving(recorder, stops, asynchronous)
    for step in steps:
        if not replay.step(arrivals, step):  # the engine ran more steps than the replay needs
            break
    else:
        replay.drain(arrivals)
    run = recorder.result()
    return run, replay.drifted or scheduler.has_unfinished() or arrivals.has_pending


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
