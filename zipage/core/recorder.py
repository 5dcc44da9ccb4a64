"""What every driver does around a step, written once: the step recorder and the finished `Run`.

A driver owns a clock and an executor; everything else about a step goes through a
`StepRecorder`, which wraps the scheduler's protocol:

    recorder.add(seq)                  a request arrives (checker notes it, progress counts a rejection)
    plan = recorder.schedule()         scheduler.schedule() + decision log + invariant checks
    ...the driver executes the plan on its clock...
    recorder.finish(plan, result)      scheduler.finish(result) + step metrics + checks + progress

or, under async scheduling (the engine plans step N+1 while step N runs):

    recorder.advance()                 scheduler.advance(): step N's deterministic part
    plan = recorder.schedule()         step N+1
    recorder.settle(plan_n, result_n)  scheduler.settle(result) + what finish does after it
    run = recorder.result()            request records, the summary, one `Run`

The instant driver, the simulator and the real engine therefore log, check, measure and report a
step identically; they differ only in how long a step takes and what it computes.

A streamed run gives the recorder a `RecordSink`: each step record, decision line and finished
request's record goes to it as it is made (`zipage.rundir.RunWriter` writes them to the run
directory) and is not kept, so memory follows the requests in flight, not the run's length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from zipage.core.arrivals import ArrivalQueue
from zipage.core.invariants import InvariantChecker
from zipage.core.metrics import MetricsRecorder, RunTotals, request_records
from zipage.core.scheduler import Scheduler
from zipage.core.sequence import Sequence
from zipage.core.step import StepPlan, StepResult
from zipage.records import RequestRecord, StepRecord


@dataclass
class Run:
    """A finished run of any driver. A streamed run's records went to its sink: `steps` and
    `decision_log` are then empty and `requests` holds only the failed ones (what a caller
    reports)."""

    summary: dict
    steps: list[StepRecord]
    requests: list[RequestRecord]
    decision_log: list[str] = field(default_factory=list)
    # Prompt + output token ids of every request; only drivers that compute tokens (the engine).
    tokens: dict[str, list[int]] = field(default_factory=dict)
    # Session turns a streamed trace gave the driver only after they came due (`ArrivalQueue.late`).
    late_turns: int = 0


class RecordSink:
    """Where a streamed run's records go as they are made; this one drops them (a run whose
    summary is all that is wanted). A sink that takes no step records (`takes_steps` False) is
    given none: none are made. One that takes no request records (`takes_requests` False; a
    sink that does not say takes them) is given those of failed and aborted requests only: a
    finished request is counted into the summary from its sequence, and no record made."""

    takes_steps = False
    takes_requests = False

    def step(self, record: StepRecord) -> None:
        pass

    def request(self, record: RequestRecord) -> None:
        pass

    def decision(self, line: str) -> None:
        pass


class StepRecorder:
    def __init__(self, scheduler: Scheduler, *, check: bool = False, log_decisions: bool = False,
                 progress: bool = False, total: int | None = None,
                 keep_sequences: bool = True, sink: RecordSink | None = None) -> None:
        self.scheduler = scheduler
        # Without a checker (which reads every finished request at the end) and when the driver
        # does not hand finished sequences to anybody, each becomes its record as it finishes
        # and is dropped: memory follows the requests in flight, not the trace.
        self.keep_sequences = keep_sequences or check
        self._records: list[RequestRecord] = []
        self.checker = InvariantChecker(scheduler) if check else None
        self.log_decisions = log_decisions
        self.decision_log: list[str] = []
        self.sink = sink
        # Whether a finished request becomes its record; if not, it is only counted.
        self._request_rows = sink is None or getattr(sink, "takes_requests", True)
        self._log = sink.decision if sink is not None else self.decision_log.append
        self.metrics = MetricsRecorder(scheduler.block_manager.num_blocks,
                                       sink.step if sink is not None else None,
                                       records=sink is None or sink.takes_steps)
        self._bar = progress_bar(total, "requests", "req") if progress else None
        self._stopped: set = set()  # requests the engine stopped at an end-of-sequence token
        self._finished_before = 0  # finished requests before the advanced step (async)
        self._started = time.perf_counter()
        self._run: Run | None = None
        # The arrival queue told of finished and aborted requests (`follow`), and the aborted
        # requests it has been told of.
        self.arrivals: ArrivalQueue | None = None
        self._aborted_seen = 0
        # Where there is nothing to do around the scheduler's own, no wrapper call: `schedule`
        # runs every step, `add` every request.
        if self.checker is None and not log_decisions:
            self.schedule = scheduler.schedule
        if self.checker is None and self._bar is None:
            self.add = scheduler.add

    def add(self, seq: Sequence) -> bool:
        """Queue a request; False if the core rejected it (it failed alone, with a reason)."""
        accepted = self.scheduler.add(seq)
        if self.checker:
            self.checker.note_added(seq)
        if not accepted:
            self._progress(1)
        return accepted

    def refuse(self, seq: Sequence, reason: str) -> None:
        """Fail a request that is never added (a session turn whose predecessor failed)."""
        self.scheduler.refuse(seq, reason)
        self._progress(1)

    def follow(self, arrivals: ArrivalQueue) -> None:
        """Tell `arrivals` of every request that finishes or is aborted from now on: a
        session's next turn is sent after its predecessor's last token."""
        self.arrivals = arrivals
        self._aborted_seen = len(self.scheduler.aborted)

    def schedule(self) -> StepPlan | None:
        if self.checker:
            self.checker.before_schedule()
        plan = self.scheduler.schedule()
        if plan is None:
            return None
        if self.log_decisions:
            self._log(plan.describe())
        if self.checker:
            self.checker.after_schedule(plan)
            self.checker.record_plan_writes(plan)
        return plan

    def finish(self, plan: StepPlan, result: StepResult) -> None:
        finished = self.scheduler.finished
        finished_before = len(finished)
        self.scheduler.finish(result)
        self._settled(plan, result, finished_before)

    def advance(self) -> None:
        """Async scheduling: `scheduler.advance()` of the plan just launched, before its result
        (the next `schedule` follows, then `settle` with the result)."""
        self._finished_before = len(self.scheduler.finished)
        self.scheduler.advance()
        if self.checker:
            self.checker.after_advance()

    def settle(self, plan: StepPlan, result: StepResult) -> None:
        """Async scheduling: the advanced plan's result, then what `finish` does after it."""
        self.scheduler.settle(result)
        self._settled(plan, result, self._finished_before)

    def _settled(self, plan: StepPlan, result: StepResult, finished_before: int) -> None:
        finished = self.scheduler.finished
        if result.stopped:
            self._stopped |= result.stopped
        self.metrics.record_step(plan, result)
        if self.checker:
            self.checker.after_finish()
        if self.arrivals is not None:
            self._tell_arrivals(finished_before, result.t_end)
        if len(finished) != finished_before:  # most steps finish nobody (this runs every step)
            self._progress(len(finished) - finished_before)
            if not self.keep_sequences:
                self._take_finished(finished)
                finished.clear()

    def _tell_arrivals(self, finished_before: int, now: float) -> None:
        scheduler, done = self.scheduler, self.arrivals.done
        for seq in scheduler.finished[finished_before:]:
            done(seq, seq.finish_time)
        aborted = scheduler.aborted
        if len(aborted) != self._aborted_seen:  # aborted between steps, or as a batch ended
            for seq in aborted[self._aborted_seen:]:
                done(seq, now)
            self._aborted_seen = len(aborted)

    def result(self, tokens: dict[str, list[int]] | None = None) -> Run:
        """Close the run: final checks, per-request records and the summary (once: a second
        call returns the same run)."""
        if self._run is not None:
            return self._run
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        scheduler = self.scheduler
        if self.checker:
            # Only requests the engine stopped at an EOS may end short of their output length.
            self.checker.at_end(self._stopped)
        self._take_finished(scheduler.finished)
        self._keep_records(request_records(scheduler.rejected + scheduler.aborted))
        summary = self.metrics.totals.summary()
        summary["wall_s"] = time.perf_counter() - self._started
        self._run = Run(summary, self.metrics.steps, self._records, self.decision_log,
                        tokens or {})
        return self._run

    def _keep_records(self, records: list[RequestRecord]) -> None:
        """Count requests into the summary, in the order `Run.requests` lists them, and keep
        them, or hand them to the sink (keeping the failed ones)."""
        totals = self.metrics.totals
        for record in records:
            totals.add_request(record)
        if self.sink is None:
            self._records += records
            return
        for record in records:
            self.sink.request(record)
            if record.error is not None:
                self._records.append(record)

    def _take_finished(self, finished: list[Sequence]) -> None:
        """`_keep_records` of finished requests; for a sink that takes none, they are counted
        into the summary (in the same order, from the fields `request_record` would give them)
        and no record is made."""
        if self._request_rows:
            self._keep_records(request_records(finished))
            return
        add_done = self.metrics.totals.add_done
        for seq in finished:
            add_done(seq.arrival_s, seq.first_token_time, seq.finish_time,
                     seq.settled_output_tokens, seq.num_compressions,
                     seq.max_blocks_after_first_compression, seq.kept_budget, seq.prompt_len)

    def forget(self) -> None:
        """Drop everything kept per step and per finished request for `result` (step records,
        the decision log, finished, aborted and rejected requests, EOS stops): a server's run
        never ends, so nothing may grow with the requests it served."""
        scheduler = self.scheduler
        scheduler.finished.clear()
        scheduler.aborted.clear()
        self._aborted_seen = 0
        scheduler.rejected.clear()
        scheduler.admission_order.clear()
        self.metrics.steps.clear()
        self.metrics.totals = RunTotals()
        self.decision_log.clear()
        self._stopped.clear()
        self._records.clear()
        self._run = None

    def _progress(self, count: int) -> None:
        if count and self._bar is not None:
            self._bar.update(count)


def progress_bar(total: int | None, desc: str, unit: str, initial: int = 0):
    """A progress bar on stderr that erases itself when closed (stdout stays clean for --json)."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit=unit, leave=False,
                mininterval=0.5, dynamic_ncols=True)
