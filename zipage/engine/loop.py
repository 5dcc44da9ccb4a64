"""The real engine's step loop: the core's step protocol on a wall clock.

Exactly the simulator's loop with the cost model replaced by the model runner: `schedule()` plans a
step, the runner executes it and samples one token per request that samples (a decode, a whole
prompt, a prompt's last chunk; a partial chunk of a chunked prefill gets none), `finish(result)` applies it with
the measured times and the requests that hit EOS. The core's decisions are the simulator's; only
the durations differ. Logging, invariant checks, metrics and progress are the shared
`StepRecorder`'s.

One `step()` serves both users: the offline `run()` (a trace's requests added when the wall clock
reaches their arrival) and the online server (`zipage.serve.engine_process`), which adds and aborts
requests between steps and streams each step's tokens out.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from zipage.core.arrivals import ArrivalQueue, Done
from zipage.core.recorder import RecordSink, Run, StepRecorder
from zipage.core.scheduler import Scheduler
from zipage.core.sequence import Sequence, SequenceStatus
from zipage.core.step import IDLE, StepPlan, StepResult
from zipage.engine.runner import Launched, ModelRunner
from zipage.engine.structured import StructuredOutputs
from zipage.errors import ConfigError, FieldError
from zipage.sessions import follow_up_tokens


@dataclass
class StepOutput:
    """What one step produced: the token each request got, and who finished in it."""

    plan: StepPlan
    tokens: list[tuple[Sequence, int]]
    finished: list[Sequence]  # reached max tokens or stopped at EOS (their blocks are free)
    # For the requests that asked (`SamplingParams.logprobs` / `prompt_logprobs`): request id ->
    # (the token's log-probability, top ids, top log-probabilities); request id -> (position of
    # the first prompt token covered, one such entry per prompt token computed this step; None
    # for the first prompt token: nothing predicts it).
    logprobs: dict[str, tuple] = field(default_factory=dict)
    prompt_logprobs: dict[str, list] = field(default_factory=dict)
    # The plans whose results this output applies, each in exactly one output: `plan` alone,
    # or under async scheduling none (a step launched, nothing settled yet) or two (the step
    # before settled, then a plan run at once). What a server counts per step.
    plans: list[StepPlan] = field(default_factory=list)


ABORTED = SequenceStatus.ABORTED


class EngineLoop:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, *,
                 eos_token_ids: frozenset[int] = frozenset(), check: bool = False,
                 log_decisions: bool = False, progress: bool = False,
                 next_token: Callable[[str, int], int] | None = None,
                 structured: StructuredOutputs | None = None,
                 sink: RecordSink | None = None) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.eos_token_ids = eos_token_ids
        self.check = check
        self.log_decisions = log_decisions
        self.progress = progress
        # Teacher forcing: (request id, sampled token) -> the token to append instead.
        self.next_token = next_token
        # The grammar matchers of constrained requests (`SamplingParams.structured_output`);
        # None: the engine has no tokenizer to compile them with, and refuses such requests.
        self.structured = structured
        # Where the run's records go as they are made (a `RunWriter`: `zipage replay --out`
        # streams both twins' runs the same way); None: kept in the `Run`.
        self.sink = sink
        self.recorder: StepRecorder | None = None
        # Prompt + output token ids of every request added (the runner reads them).
        self.tokens: dict[str, list[int]] = {}
        # An offline run's log-probabilities, for the requests that asked: request id -> one
        # entry per output token, and per prompt token (`StepOutput`). The server reads them
        # from each step's output instead.
        self.collect_logprobs = False
        self.logprobs: dict[str, list] = {}
        self.prompt_logprobs: dict[str, list] = {}
        self._started = time.perf_counter()
        # Async scheduling (`ZipageConfig.async_scheduling`): the step launched and not yet
        # settled, and when its plan was made; and when the step settled last ended.
        self.async_scheduling = scheduler.config.async_scheduling
        if self.async_scheduling and next_token is not None:
            raise ConfigError("async_scheduling: a teacher-forced run needs each token on the "
                              "host before the next step; turn async scheduling off")
        self._running: tuple[StepPlan, Launched, float, bool] | None = None
        self._last_end = 0.0
        self._left_early: set[str] = set()  # stopped in the step settled last
        self._advanced_from = 0  # the finished list's length before the last advance

    def start(self, total: int | None = None) -> None:
        """Open a run: a fresh recorder, and the clock at 0 (`run` does it; a server once)."""
        self.recorder = StepRecorder(self.scheduler, check=self.check,
                                     log_decisions=self.log_decisions,
                                     progress=self.progress, total=total, sink=self.sink)
        self.tokens = {}
        self._started = time.perf_counter()

    def now(self) -> float:
        """Seconds on the run's clock (arrival, first-token and finish times use it)."""
        return time.perf_counter() - self._started

    def add(self, seq: Sequence) -> bool:
        """Queue a request; False if the core rejected it (`seq.error` says why)."""
        if seq.sampling is not None and seq.sampling.structured_output is not None:
            if self.structured is None:
                raise FieldError("structured_output", "this engine has no tokenizer to compile a "
                                                      "grammar with")
            self.structured.prepare(seq)  # a spec that does not compile fails here, alone
        # A request without prompt tokens is one the scheduler rejects before it ever runs.
        if seq.prompt_token_ids is not None:
            self.tokens[seq.seq_id] = list(seq.prompt_token_ids)
        return self.recorder.add(seq)

    def abort(self, seq_id: str) -> bool:
        """Drop a request between steps (`Scheduler.abort`); its blocks are freed."""
        if self.structured is not None:
            self.structured.release(seq_id)
        return self.scheduler.abort(seq_id)

    @property
    def busy(self) -> bool:
        """Requests queued or running, or a step launched and not settled (async scheduling)."""
        return self._running is not None or self.scheduler.has_unfinished()

    def step(self, started_at: float | None = None) -> StepOutput | None:
        """Schedule, execute and finish one step; None when no request is queued.

        `started_at`: when the iteration that admitted this step's arrivals began (default now).
        A step starts there: admission and scheduling are host time the step costs, and a
        step-time replay (sim/step_replay.py) admits arrivals up to exactly that instant.

        Under async scheduling a call launches the next step and returns the one before it,
        settled (docs/architecture.md, 'Async scheduling')."""
        if self.async_scheduling:
            return self._step_async(started_at)
        runner = self.runner
        t_start = self.now() if started_at is None else started_at
        plan = self.recorder.schedule()
        if plan is None:
            return None
        structured = self.structured
        sampled = runner.execute(plan, self.tokens, structured)
        # An idle step exists only to wait for the in-flight compression batch.
        completed = (runner.compressor.completed(wait=plan.kind == IDLE)
                     if runner.compressor is not None else [])
        t_end = self.now()
        return self._finished_step(plan, sampled, t_start, t_end, completed, settle=False)

    def _step_async(self, started_at: float | None) -> StepOutput | None:
        """Advance the running step, plan and launch the next one, then wait for the running
        step's tokens and settle it. A plan that needs its tokens on the host first (a grammar,
        penalties) or only waits (idle) runs after the settle, synchronously."""
        t_plan = self.now() if started_at is None else started_at
        running, self._running = self._running, None
        if running is not None:
            self._advance()
        plan = self.recorder.schedule()
        if plan is None:
            return None if running is None else self._settle(*running)
        early = running is not None  # planned while the step before still runs
        if plan.kind == IDLE or self.runner.needs_sync(plan):
            if running is None:
                return self._step_now(plan, t_plan, early)
            output = self._settle(*running)
            return _merged(output, self._step_now(plan, t_plan, early))
        launched = self.runner.launch(plan, self.tokens,
                                      running[1] if running is not None else None)
        self._running = (plan, launched, t_plan, early)
        if running is None:
            return StepOutput(plan, [], [])  # (settles nothing: `plans` is empty)
        # A batch the new step launched is not the settled step's to report done.
        return self._settle(*running, poll=plan.compress_launch is None)

    def _settle(self, plan: StepPlan, launched: Launched, t_plan: float, early: bool,
                poll: bool = True) -> StepOutput:
        """Wait for a launched step's tokens and settle it. It started when its plan was made,
        or, planned while the step before ran, when that one ended."""
        sampled = launched.tokens()
        completed = (self.runner.compressor.completed()
                     if poll and self.runner.compressor is not None else [])
        t_end = self.now()
        return self._finished_step(plan, sampled, max(t_plan, self._last_end), t_end,
                                   completed, settle=True, timing=(t_plan, early, True))

    def _step_now(self, plan: StepPlan, t_plan: float, early: bool) -> StepOutput:
        """A plan of async scheduling run synchronously: executed, waited for, advanced and
        settled."""
        t_start = max(t_plan, self._last_end)
        sampled = self.runner.execute(plan, self.tokens, self.structured)
        completed = (self.runner.compressor.completed(wait=plan.kind == IDLE)
                     if self.runner.compressor is not None else [])
        self._advance()
        return self._finished_step(plan, sampled, t_start, self.now(), completed, settle=True,
                                   timing=(t_plan, early, False))

    def _advance(self) -> None:
        """Async scheduling: the step to settle next is advanced (its length finishes included:
        they are that step's to report, so where the finished list stood is kept)."""
        self._advanced_from = len(self.scheduler.finished)
        self.recorder.advance()

    def _finished_step(self, plan: StepPlan, sampled: list, t_start: float, t_end: float,
                       completed: list[int], settle: bool,
                       timing: tuple[float, bool, bool] = (-1.0, False, False)) -> StepOutput:
        """A step's tokens in: appended, stops found, the result applied (`finish`, or under
        async scheduling `settle` of the advanced step). A request that left the running set
        while the step ran (stopped in the step before, or aborted) gets no token."""
        scheduler, runner, structured = self.scheduler, self.runner, self.structured
        self._last_end = t_end
        stopped = set()
        produced = []
        if settle and sampled:
            left = self._left_early
            sampled = [(seq, token) for seq, token in sampled
                       if seq.status is not ABORTED and seq.seq_id not in left]
        for seq, token in sampled:
            if self.next_token is not None:
                token = self.next_token(seq.seq_id, token)
            self.tokens[seq.seq_id].append(token)
            produced.append((seq, token))
            if token in self.eos_token_ids and not seq.sampling.ignore_eos:
                stopped.add(seq.seq_id)
        if structured is not None and structured.matchers:
            structured.advance(produced)
            stopped.update(seq.seq_id for seq, _ in produced if structured.finished(seq.seq_id))
        # A request that reached its length finished at the advance, before this settle.
        finished_before = self._advanced_from if settle else len(scheduler.finished)
        # `timing`, async scheduling: when the plan was made, and how it interleaved (StepResult).
        result = StepResult(plan.step_id, t_start, t_end, completed, stopped, *timing)
        if settle:
            # Settled after the next plan was made: a request stopped here decoded in that one
            # too, and its token there is dropped.
            self.recorder.settle(plan, result)
            self._left_early = stopped
        else:
            self.recorder.finish(plan, result)
        if structured is not None and structured.matchers:
            for seq in scheduler.finished[finished_before:]:
                structured.release(seq.seq_id)
        logprobs, prompt_logprobs = runner.last_logprobs, runner.last_prompt_logprobs
        if self.collect_logprobs:
            for seq_id, entry in logprobs.items():
                self.logprobs.setdefault(seq_id, []).append(entry)
            for seq_id, (position, entries) in prompt_logprobs.items():
                add_prompt_logprobs(self.prompt_logprobs.setdefault(seq_id, []), position,
                                    entries)
        return StepOutput(plan, produced, scheduler.finished[finished_before:], logprobs,
                          prompt_logprobs, [plan])

    def run(self, sequences: list[Sequence], users: int | None = None) -> Run:
        """Run every request (each carries its prompt tokens and `SamplingParams`) to the end;
        a session's next turn when its predecessor finished, and with `users` a session when
        a user is free (zipage/core/arrivals.py)."""
        self.start(total=len(sequences))
        self.collect_logprobs = True
        self.logprobs, self.prompt_logprobs = {}, {}
        arrivals = ArrivalQueue(sequences, on_release=self._follow_up, users=users)
        self.recorder.follow(arrivals)
        while arrivals.has_pending or self.busy:
            now = self.now()
            arrivals.admit_due(self, now)
            if self.step(started_at=now) is None and arrivals.has_pending:
                due = arrivals.next_arrival_s  # (nothing in flight: a due time is known)
                time.sleep(max(0.0, due - now) if due is not None else 0.0)
        return self.recorder.result(self.tokens)

    def refuse(self, seq: Sequence, reason: str) -> None:
        """Fail a request that is never added (a session turn whose predecessor failed)."""
        self.recorder.refuse(seq, reason)

    def _follow_up(self, seq: Sequence, predecessor: Done) -> None:
        """A session's next turn comes due: its prompt is the history its predecessor really
        produced, then its own tokens (held in its prompt until now)."""
        if seq.prompt_token_ids is None:  # rejected when it was read: it will be again
            return
        seq.prompt_token_ids = follow_up_tokens(
            self.tokens[predecessor.seq_id], predecessor.prompt_len, predecessor.reasoning_len,
            seq.turn.shared_len, seq.prompt_token_ids)
        seq.prompt_len = len(seq.prompt_token_ids)


def _merged(first: StepOutput, second: StepOutput) -> StepOutput:
    """Two steps settled in one call (async scheduling), as one output."""
    return StepOutput(second.plan, first.tokens + second.tokens, first.finished + second.finished,
                      {**first.logprobs, **second.logprobs},
                      {**first.prompt_logprobs, **second.prompt_logprobs},
                      first.plans + second.plans)


def add_prompt_logprobs(stored: list, position: int, entries: list) -> None:
    """Put a step's prompt log-probabilities (from prompt token `position` on) into a request's
    list, replacing any reported before from there (a prompt chunk computed again)."""
    del stored[position:]
    stored.extend(entries)
