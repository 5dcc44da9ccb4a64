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
from zipage.core.sequence import Sequence
from zipage.core.step import StepResult


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


class InstantDriver:
    def __init__(self, scheduler: Scheduler, compress_delay: int | tuple[int, int] = 0,
                 seed: int = 0, check: bool = False, log_decisions: bool = False) -> None:
        self.scheduler = scheduler
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
        now = 0
        while arrivals.has_pending or self.scheduler.has_unfinished():
            arrivals.admit_due(recorder, now)
            while pending_aborts and pending_aborts[0][0] <= now:
                self.scheduler.abort(pending_aborts.pop(0)[1])
            plan = recorder.schedule()
            if plan is None:  # nothing queued: jump to the next arrival, if any
                if not arrivals.has_pending:
                    break
                now = max(now + 1, int(arrivals.next_arrival_s))  # (nothing is in flight)
                continue
            if plan.step_id > bound:
                raise StepBoundExceeded(f"run exceeded its step bound {bound}")
            if plan.compress_launch is not None:
                delay = self.rng.randint(*self.delay_range)
                completions[plan.compress_launch.batch_id] = plan.step_id + delay
            result = StepResult(step_id=plan.step_id, t_start=float(now), t_end=float(now + 1))
            result.completed_batches = [
                batch for batch, due in completions.items() if due <= plan.step_id]
            for batch in result.completed_batches:
                del completions[batch]
            recorder.finish(plan, result)
            now += 1
        return recorder.result()
