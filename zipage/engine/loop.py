"""The real engine's step loop: the core's step protocol on a wall clock.

Exactly the simulator's loop with the cost model replaced by the model runner: requests are added
when the wall clock reaches their arrival, `schedule()` plans a step, the runner executes it and
samples one token per request, `finish(result)` applies it with the measured times and the requests
that hit EOS. The core's decisions are the simulator's; only the durations differ. Logging,
invariant checks, metrics and progress are the shared `StepRecorder`'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from zipage.core.arrivals import ArrivalQueue
from zipage.core.recorder import Run, StepRecorder
from zipage.core.scheduler import Scheduler
from zipage.core.sequence import Sequence
from zipage.core.step import IDLE, StepResult
from zipage.engine.runner import ModelRunner


class EngineLoop:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, *,
                 eos_token_ids: frozenset[int] = frozenset(), check: bool = False,
                 log_decisions: bool = False, progress: bool = False,
                 next_token: Callable[[str, int], int] | None = None) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.eos_token_ids = eos_token_ids
        self.check = check
        self.log_decisions = log_decisions
        self.progress = progress
        # Teacher forcing: (request id, sampled token) -> the token to append instead.
        self.next_token = next_token

    def run(self, sequences: list[Sequence]) -> Run:
        """Run every request (each carries its prompt tokens and `SamplingParams`) to the end."""
        scheduler, runner = self.scheduler, self.runner
        recorder = StepRecorder(scheduler, check=self.check, log_decisions=self.log_decisions,
                                progress=self.progress, total=len(sequences))
        # A request without prompt tokens is one the scheduler rejects before it ever runs.
        tokens = {seq.seq_id: list(seq.prompt_token_ids) for seq in sequences
                  if seq.prompt_token_ids is not None}
        arrivals = ArrivalQueue(sequences)
        started = time.perf_counter()
        while arrivals.has_pending or scheduler.has_unfinished():
            now = time.perf_counter() - started
            arrivals.admit_due(recorder.add, now)
            plan = recorder.schedule()
            if plan is None:
                if arrivals.has_pending:
                    time.sleep(max(0.0, arrivals.next_arrival_s - now))
                continue
            # A step starts when its iteration does: admission and scheduling are host time the
            # step costs, and a step-time replay admits arrivals up to exactly this instant.
            t_start = now
            sampled = runner.execute(plan, tokens)
            # An idle step exists only to wait for the in-flight compression batch.
            completed = (runner.compressor.completed(wait=plan.kind == IDLE)
                         if runner.compressor is not None else [])
            t_end = time.perf_counter() - started
            stopped = set()
            for seq, token in sampled:
                if self.next_token is not None:
                    token = self.next_token(seq.seq_id, token)
                tokens[seq.seq_id].append(token)
                if token in self.eos_token_ids and not seq.sampling.ignore_eos:
                    stopped.add(seq.seq_id)
            recorder.finish(plan, StepResult(step_id=plan.step_id, t_start=t_start, t_end=t_end,
                                             completed_batches=completed, stopped=stopped))
        return recorder.result(tokens)
