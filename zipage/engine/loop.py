"""The real engine's step loop: the core's step protocol on a wall clock.

Exactly the simulator's loop with the cost model replaced by the model runner: requests are added
when the wall clock reaches their arrival, `schedule()` plans a step, the runner executes it and
samples one token per request, `finish(result)` applies it with the measured times and the requests
that hit EOS. The core's decisions are the simulator's; only the durations differ.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from zipage.core.arrivals import ArrivalQueue
from zipage.core.invariants import InvariantChecker
from zipage.core.metrics import MetricsRecorder, request_records, summarize
from zipage.core.step import IDLE, StepResult
from zipage.core.scheduler import Scheduler
from zipage.core.sequence import Sequence
from zipage.engine.runner import ModelRunner
from zipage.engine.sampler import SamplingParams


@dataclass
class EngineRun:
    summary: dict
    steps: list
    requests: list
    tokens: dict[str, list[int]]  # prompt + output token ids of every request
    decision_log: list[str] = field(default_factory=list)


class EngineLoop:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, *,
                 eos_token_ids: frozenset[int] = frozenset(), check: bool = False,
                 log_decisions: bool = False, progress: bool = False,
                 next_token: Callable[[str, int], int] | None = None) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.eos_token_ids = eos_token_ids
        self.checker = InvariantChecker(scheduler) if check else None
        self.log_decisions = log_decisions
        self.progress = progress
        self.metrics = MetricsRecorder(scheduler.block_manager.num_blocks)
        # Teacher forcing: (request id, sampled token) -> the token to append instead.
        self.next_token = next_token

    def run(self, sequences: list[Sequence], prompts: dict[str, list[int]],
            params: dict[str, SamplingParams], ignore_eos: dict[str, bool]) -> EngineRun:
        scheduler, checker, runner = self.scheduler, self.checker, self.runner
        tokens = {seq_id: list(prompt) for seq_id, prompt in prompts.items()}
        arrivals = ArrivalQueue(sequences)
        bar = _progress_bar(len(sequences)) if self.progress else None
        log: list[str] = []
        started = time.perf_counter()
        finished_before = 0
        while arrivals.has_pending or scheduler.has_unfinished():
            now = time.perf_counter() - started
            arrivals.admit_due(scheduler, now, checker)
            plan = scheduler.schedule()
            if plan is None:
                if arrivals.has_pending:
                    time.sleep(max(0.0, arrivals.next_arrival_s - now))
                continue
            if self.log_decisions:
                log.append(plan.describe())
            if checker:
                checker.after_schedule(plan)
                checker.record_plan_writes(plan)
            t_start = time.perf_counter() - started
            sampled = runner.execute(plan, tokens, params)
            # An idle step exists only to wait for the in-flight compression batch.
            completed = (runner.compressor.completed(wait=plan.kind == IDLE)
                         if runner.compressor is not None else [])
            t_end = time.perf_counter() - started
            stopped = set()
            for seq_id, token in sampled.items():
                if self.next_token is not None:
                    token = self.next_token(seq_id, token)
                tokens[seq_id].append(token)
                if token in self.eos_token_ids and not ignore_eos[seq_id]:
                    stopped.add(seq_id)
            result = StepResult(step_id=plan.step_id, t_start=t_start, t_end=t_end,
                                completed_batches=completed, stopped=stopped)
            scheduler.finish(result)
            self.metrics.record_step(plan, result)
            if checker:
                checker.after_finish()
            if bar is not None and len(scheduler.finished) != finished_before:
                bar.update(len(scheduler.finished) - finished_before)
                finished_before = len(scheduler.finished)
        if bar is not None:
            bar.close()
        if checker:
            stopped_early = {seq.seq_id for seq in scheduler.finished
                             if seq.num_output_tokens < seq.max_output_tokens}
            checker.at_end(stopped_early)
        requests = request_records(scheduler.finished + scheduler.rejected)
        summary = summarize(self.metrics.steps, requests)
        summary["wall_s"] = time.perf_counter() - started
        return EngineRun(summary, self.metrics.steps, requests, tokens, log)


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", leave=False, mininterval=0.5)
