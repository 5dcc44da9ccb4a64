"""What every driver does around a step, written once: the step recorder and the finished `Run`.

A driver owns a clock and an executor; everything else about a step goes through a
`StepRecorder`, which wraps the scheduler's protocol:

    recorder.add(seq)                  a request arrives (checker notes it, progress counts a rejection)
    plan = recorder.schedule()         scheduler.schedule() + decision log + invariant checks
    ...the driver executes the plan on its clock...
    recorder.finish(plan, result)      scheduler.finish(result) + step metrics + checks + progress
    run = recorder.result()            request records, the summary, one `Run`

The instant driver, the simulator and the real engine therefore log, check, measure and report a
step identically; they differ only in how long a step takes and what it computes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from zipage.core.invariants import InvariantChecker
from zipage.core.metrics import MetricsRecorder, RequestRecord, StepRecord, request_records, summarize
from zipage.core.scheduler import Scheduler
from zipage.core.sequence import Sequence
from zipage.core.step import StepPlan, StepResult


@dataclass
class Run:
    """A finished run of any driver."""

    summary: dict
    steps: list[StepRecord]
    requests: list[RequestRecord]
    decision_log: list[str] = field(default_factory=list)
    # Prompt + output token ids of every request; only drivers that compute tokens (the engine).
    tokens: dict[str, list[int]] = field(default_factory=dict)


class StepRecorder:
    def __init__(self, scheduler: Scheduler, *, check: bool = False, log_decisions: bool = False,
                 progress: bool = False, total: int | None = None,
                 keep_sequences: bool = True) -> None:
        self.scheduler = scheduler
        # Without a checker (which reads every finished request at the end) and when the driver
        # does not hand finished sequences to anybody, each becomes its record as it finishes
        # and is dropped: memory follows the requests in flight, not the trace.
        self.keep_sequences = keep_sequences or check
        self._records: list[RequestRecord] = []
        self.checker = InvariantChecker(scheduler) if check else None
        self.log_decisions = log_decisions
        self.decision_log: list[str] = []
        self.metrics = MetricsRecorder(scheduler.block_manager.num_blocks)
        self._bar = progress_bar(total, "requests", "req") if progress else None
        self._stopped: set = set()  # requests the engine stopped at an end-of-sequence token
        self._started = time.perf_counter()

    def add(self, seq: Sequence) -> bool:
        """Queue a request; False if the core rejected it (it failed alone, with a reason)."""
        accepted = self.scheduler.add(seq)
        if self.checker:
            self.checker.note_added(seq)
        if not accepted:
            self._advance(1)
        return accepted

    def schedule(self) -> StepPlan | None:
        if self.checker:
            self.checker.before_schedule()
        plan = self.scheduler.schedule()
        if plan is None:
            return None
        if self.log_decisions:
            self.decision_log.append(plan.describe())
        if self.checker:
            self.checker.after_schedule(plan)
            self.checker.record_plan_writes(plan)
        return plan

    def finish(self, plan: StepPlan, result: StepResult) -> None:
        scheduler = self.scheduler
        finished_before = len(scheduler.finished)
        scheduler.finish(result)
        newly_finished = len(scheduler.finished) - finished_before
        if not self.keep_sequences:
            self._records += request_records(scheduler.finished)
            scheduler.finished.clear()
        self._stopped |= result.stopped
        self.metrics.record_step(plan, result)
        if self.checker:
            self.checker.after_finish()
        self._advance(newly_finished)

    def result(self, tokens: dict[str, list[int]] | None = None) -> Run:
        """Close the run: final checks, per-request records and the summary."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        scheduler = self.scheduler
        if self.checker:
            # Only requests the engine stopped at an EOS may end short of their output length.
            self.checker.at_end(self._stopped)
        requests = self._records + request_records(
            scheduler.finished + scheduler.rejected + scheduler.aborted)
        summary = summarize(self.metrics.steps, requests)
        summary["wall_s"] = time.perf_counter() - self._started
        return Run(summary, self.metrics.steps, requests, self.decision_log, tokens or {})

    def forget(self) -> None:
        """Drop everything kept per step and per finished request for `result` (step records,
        the decision log, finished, aborted and rejected requests, EOS stops): a server's run
        never ends, so nothing may grow with the requests it served."""
        scheduler = self.scheduler
        scheduler.finished.clear()
        scheduler.aborted.clear()
        scheduler.rejected.clear()
        scheduler.admission_order.clear()
        self.metrics.steps.clear()
        self.decision_log.clear()
        self._stopped.clear()
        self._records.clear()

    def _advance(self, count: int) -> None:
        if count and self._bar is not None:
            self._bar.update(count)


def progress_bar(total: int | None, desc: str, unit: str, initial: int = 0):
    """A progress bar on stderr that erases itself when closed (stdout stays clean for --json)."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit=unit, leave=False,
                mininterval=0.5, dynamic_ncols=True)
