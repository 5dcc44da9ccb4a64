"""The instant driver: runs plans at zero cost, for tests and fast regression runs.

Each step takes one unit of time; async compression batches complete a configurable number of
steps after their launch; output tokens are deterministic numbers (the scheduling never depends
on them). With `check=True` every step goes through the `InvariantChecker`, and the run fails if
it exceeds the step bound derived in docs/architecture.md ("Deadlock freedom").
"""

from __future__ import annotations

import random

from zipage.core.arrivals import ArrivalQueue
from zipage.core.recorder import Run, StepRecorder
from zipage.core.scheduler import Scheduler
from zipage.core.sequence import Sequence, SequenceStatus
from zipage.core.step import IDLE, StepResult


class StepBoundExceeded(AssertionError):
    pass


def step_bound(sequences: list[Sequence], scheduler: Scheduler, max_delay: int) -> int:
    """Upper bound on the steps of a run (derived in docs/architecture.md, "Deadlock freedom").

    Steps that decode decode at least one request each and tokens are never lost (a preempted
    request keeps its outputs): at most T = sum of output lengths. A step preempts each request
    at most once, so preemptions <= R * T, and admissions A <= R + R * T. Prefill steps admit at
    least one request each: at most A. With chunked prefill a step without decodes either
    completes some request's prefill (at most A such steps) or computes a whole budget of
    max_num_batched_tokens prompt tokens, of at most A * L in all (L: the longest prompt +
    output). Idle steps wait for an async batch: at most (max_delay + 1) per batch, and batches
    <= compressions <= sum(1 + output_len // block_size) (compressed requests are never
    preempted, so no compression is redone).
    """
    requests = len(sequences)
    tokens = sum(seq.max_output_tokens for seq in sequences)
    compressions = sum(1 + seq.max_output_tokens // scheduler.block_size for seq in sequences)
    admissions = requests + requests * tokens
    prefill_steps = admissions
    config = scheduler.config
    if config.chunked_prefill:
        longest = max((seq.prompt_len + seq.max_output_tokens for seq in sequences), default=0)
        prefill_steps += -(-admissions * longest // config.step_tokens)
    return prefill_steps + tokens + compressions * (max_delay + 1)


# Still the scheduler's: running, or preempted by the plan made after this step (async).
LIVE = (SequenceStatus.RUNNING, SequenceStatus.WAITING)


def reached_stops(plan, stops: dict[str, int], produced: int = 0) -> set[str]:
    """The requests of `plan` that sampled the token of their stop (`stops`: request id -> the
    output token it samples an end-of-sequence at); `produced`: 1 where the plan's token is not
    counted yet (synchronously), 0 after `advance`. A request that left while the step ran (a
    stop the step before, an abort) gets no token, so it stops nothing."""
    return {seq.seq_id for seq in Scheduler.sampled_requests(plan)
            if seq.seq_id in stops and seq.status in LIVE
            and seq.num_output_tokens + produced == stops[seq.seq_id]}


class InstantDriver:
    def __init__(self, scheduler: Scheduler, compress_delay: int | tuple[int, int] = 0,
                 seed: int = 0, check: bool = False, log_decisions: bool = False,
                 stops: dict[str, int] | None = None, asynchronous: bool = False) -> None:
        self.scheduler = scheduler
        # request id -> the output token it samples an end-of-sequence at (its stop); and
        # whether to drive the core's async protocol (advance, schedule the next, settle), as
        # the engine's async scheduling does (docs/architecture.md, 'Async scheduling').
        self.stops = stops or {}
        self.asynchronous = asynchronous
        # A fixed delay in steps, or a (low, high) range drawn per batch.
        self.delay_range = compress_delay if isinstance(compress_delay, tuple) else (
            compress_delay, compress_delay)
        self.rng = random.Random(seed)
        self.recorder = StepRecorder(scheduler, check=check, log_decisions=log_decisions)

    def run(self, sequences: list[Sequence], aborts: dict[str, int] | None = None) -> Run:
        """Add each request once the clock reaches its arrival (in steps), run to the end.

        `aborts`: request id -> time (in steps) its client goes away (`Scheduler.abort` between
        steps, as a server does)."""
        recorder = self.recorder
        arrivals = ArrivalQueue(sequences)
        recorder.follow(arrivals)
        pending_aborts = sorted((at, seq_id) for seq_id, at in (aborts or {}).items())
        bound = step_bound(sequences, self.scheduler, self.delay_range[1])
        completions: dict[int, int] = {}  # batch id -> step whose result reports it done
        running = None  # async: the step launched and not settled, and its start
        now = 0
        while arrivals.has_pending or self.scheduler.has_unfinished() or running is not None:
            arrivals.admit_due(recorder, now)
            while pending_aborts and pending_aborts[0][0] <= now:
                self.scheduler.abort(pending_aborts.pop(0)[1])
            if running is not None:
                recorder.advance()
            plan = recorder.schedule()
            if plan is not None and running is not None and plan.kind == IDLE:
                self._settle(*running, completions)  # an idle plan waits for the step before
                running = None
            if plan is None:  # nothing queued: settle the running step, or jump to an arrival
                if running is not None:
                    self._settle(*running, completions)
                    running = None
                    continue
                if not arrivals.has_pending:
                    break
                now = max(now + 1, int(arrivals.next_arrival_s))  # (nothing is in flight)
                continue
            if plan.step_id > bound:
                raise StepBoundExceeded(f"run exceeded its step bound {bound}")
            if plan.compress_launch is not None:
                delay = self.rng.randint(*self.delay_range)
                completions[plan.compress_launch.batch_id] = plan.step_id + delay
            if not self.asynchronous or plan.kind == IDLE:
                result = self._result(plan, now, completions, produced=1)
                recorder.finish(plan, result)
            else:
                if running is not None:
                    self._settle(*running, completions)
                running = (plan, now)
            now += 1
        return recorder.result()

    def _settle(self, plan, now: int, completions: dict[int, int]) -> None:
        """Async: the launched step's result, after the next plan was made (its requests' counters
        count its token already)."""
        result = self._result(plan, now, completions, produced=0)
        self.recorder.settle(plan, result)

    def _result(self, plan, now: int, completions: dict[int, int], produced: int) -> StepResult:
        """Plan `plan`'s result: its batches due and its stops (a request that sampled the token
        of its stop; `produced`: 1 where the plan's token is not counted yet, synchronously)."""
        result = StepResult(step_id=plan.step_id, t_start=float(now), t_end=float(now + 1))
        result.completed_batches = [
            batch for batch, due in completions.items() if due <= plan.step_id]
        for batch in result.completed_batches:
            del completions[batch]
        if self.stops:
            result.stopped = reached_stops(plan, self.stops, produced)
        return result
