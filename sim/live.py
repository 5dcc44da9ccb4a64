"""The live twin: the simulator's engine loop on the wall clock, for `zipage serve --simulate`.

The engine process of `zipage serve` (zipage/serve/engine_process.py) drives a `LiveTwin` as it
drives the real engine's `EngineLoop`: between steps it applies the adds and aborts that arrived,
then calls `step()`, then sends the step's tokens out. A step here is the simulator's
(`Simulator._engine_loop`, sim/simulator.py): `recorder.schedule()`, the cost model's duration of
the plan (`step_duration`: contention beside an async compression batch included), an async batch
completing `compress_time` after the end of the step that launched it, `recorder.finish(plan,
result)`. Same core, same cost model; only the clock differs: the twin sleeps until the wall clock
reaches the step's predicted end.

Clock. While requests are in flight, steps run back to back on the predicted timeline: a step
starts where the previous one was predicted to end, so the host's own work between steps
(applying commands, sending tokens) happens inside the predicted duration instead of adding to
it, and the twin keeps the simulator's pace. A step whose predicted end has already passed when
its work is done is late: it ends when the host got there (the next step starts from the real
time, so lateness never piles up into a burst of catch-up steps) and the lateness is counted
(`lag_s`, `late_steps`, /metrics `zipage:twin_lag_seconds_total`): those steps took longer than
the model says, and the host is what to look at.

Tokens. There is no model: each request that samples in a step gets the next token of its own
deterministic stream (`twin_token`), drawn from the vocabulary less `avoid_token_ids` (the
tokenizer's special tokens, end-of-sequence among them), so a request never stops early: it ends
at its max_tokens (or at a stop string the HTTP side finds in the text, or when its client
leaves). Log-probabilities have no model to come from: a request that asks for them is refused
alone, with the reason.
"""

from __future__ import annotations

import heapq
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from zipage.core.recorder import StepRecorder
from zipage.core.sequence import Sequence
from zipage.core.step import IDLE, StepPlan, StepResult
from zipage.errors import ConfigError, FieldError
from zipage.sim.simulate import SimulatedDeployment
from zipage.sim.simulator import step_duration

_STRIDE = 7919  # a prime: one request's consecutive tokens spread over the vocabulary


@dataclass
class TwinStep:
    """What one step produced, in the fields the engine process reads of the engine's
    `StepOutput` (zipage/engine/loop.py): the token each request got, who finished."""

    plan: StepPlan
    tokens: list[tuple[Sequence, int]]
    finished: list[Sequence]
    # Never any: there is no model (a request that asks for them is refused).
    logprobs: dict = field(default_factory=dict)
    prompt_logprobs: dict = field(default_factory=dict)

    @property
    def plans(self) -> list[StepPlan]:
        """The plans this step settles: its own (the twin steps synchronously)."""
        return [self.plan]


def twin_token(seq_id: str, position: int, vocab_size: int, avoid: frozenset[int]) -> int:
    """The token at `position` of request `seq_id`'s output: a fixed stream per request, never a
    token of `avoid`."""
    token = (zlib.crc32(seq_id.encode()) + position * _STRIDE) % vocab_size
    while token in avoid:
        token = (token + 1) % vocab_size
    return token


class LiveTwin:
    """The simulated engine of one replica, stepped in real time (see the module docstring).
    It offers what the engine process calls on an `EngineLoop`: `start`, `now`, `add`, `abort`,
    `step`, and the attributes `scheduler`, `recorder`, `tokens`, `eos_token_ids`."""

    def __init__(self, deployment: SimulatedDeployment,
                 avoid_token_ids: frozenset[int] = frozenset(), *,
                 clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.deployment = deployment
        self.scheduler = deployment.new_scheduler()
        self.scheduler.decode_lists = True  # the requests a step decodes get its tokens
        self.cost_model = deployment.cost_model
        self.vocab_size = deployment.shape.vocab_size
        self.avoid = frozenset(token for token in avoid_token_ids if 0 <= token < self.vocab_size)
        if len(self.avoid) >= self.vocab_size:
            raise ConfigError("--simulate: every token of the vocabulary is a special token; "
                              "the twin has none left to generate")
        self.eos_token_ids: frozenset[int] = frozenset()  # never generated (see `avoid`)
        self.recorder: StepRecorder | None = None
        # Each request's latest token (the engine's loop keeps prompt + output; only the last
        # is read here, by the engine process when the request finishes).
        self.tokens: dict[str, list[int]] = {}
        self.lag_s = 0.0  # seconds steps ended after their predicted end, in all
        self.late_steps = 0
        self._clock, self._sleep = clock, sleep
        self._started = clock()
        self._free_at = 0.0  # the previous step's end (the run's clock)
        self._chained = False  # requests were in flight at its end: the next starts there
        self._batches: list[tuple[float, int]] = []  # async batches in flight: (end, id)
        self._compression_ends_at = 0.0  # the latest launched batch's end (its contention)

    def start(self, total: int | None = None) -> None:
        """Open the run: a fresh recorder, the clock at 0 (the engine process does it once)."""
        self.recorder = StepRecorder(self.scheduler, total=total)
        self.tokens = {}
        self._started = self._clock()
        self._free_at, self._chained = 0.0, False

    def now(self) -> float:
        return self._clock() - self._started

    def add(self, seq: Sequence) -> bool:
        sampling = seq.sampling
        if sampling is not None and (sampling.logprobs is not None
                                     or sampling.prompt_logprobs is not None):
            raise FieldError("logprobs", "a simulated server (zipage serve --simulate) has no "
                                         "model to take log-probabilities from; leave logprobs "
                                         "(and echo's prompt log-probabilities) out")
        if sampling is not None and sampling.structured_output is not None:
            raise FieldError("structured_output", "a simulated server (zipage serve "
                                                  "--simulate) generates tokens without a model "
                                                  "and cannot follow a grammar; leave "
                                                  "response_format and guided_* out")
        self.tokens[seq.seq_id] = []
        return self.recorder.add(seq)

    def abort(self, seq_id: str) -> bool:
        return self.scheduler.abort(seq_id)

    @property
    def busy(self) -> bool:
        """Requests queued or running (the engine loop's `busy`; the twin launches no step
        ahead)."""
        return self.scheduler.has_unfinished()

    def step(self, started_at: float | None = None) -> TwinStep | None:
        """Schedule one step, wait until its predicted end, finish it; None when nothing is
        queued. `started_at` is the engine loop's argument (when the iteration began); the
        twin's steps start on the predicted timeline instead (see the module docstring)."""
        plan = self.recorder.schedule()
        if plan is None:
            self._chained = False
            return None
        now = self.now()
        t_start = self._free_at if self._chained else max(now, self._free_at)
        cost, batches, idle = self.cost_model, self._batches, plan.kind == IDLE
        duration = 0.0 if idle else step_duration(cost, plan, t_start, self._compression_ends_at)
        launch = plan.compress_launch
        if launch is not None:  # it starts when the step's forward ends (as the simulator)
            self._compression_ends_at = t_start + duration + cost.compress_time(launch.jobs)
            launched = (self._compression_ends_at, launch.batch_id)
            if idle:  # waited for below
                heapq.heappush(batches, launched)
        if idle:  # nothing runnable: the step waits for the batch in flight
            duration = max(0.0, batches[0][0] - t_start) if batches else 0.0
        t_end = self._wait_until(t_start + duration)
        completed = []
        while batches and batches[0][0] <= t_end:
            completed.append(heapq.heappop(batches)[1])
        if launch is not None and not idle:
            # Only later steps see it done, however late this one ended (as in the simulator,
            # where it ends after the step that launched it).
            heapq.heappush(batches, launched)
        produced = []
        avoid, vocab, tokens = self.avoid, self.vocab_size, self.tokens
        for seq in plan.sampled:
            token = twin_token(seq.seq_id, seq.num_output_tokens, vocab, avoid)
            tokens[seq.seq_id] = [token]
            produced.append((seq, token))
        finished = self.scheduler.finished
        before = len(finished)
        self.recorder.finish(plan, StepResult(plan.step_id, t_start, t_end, completed))
        self._free_at = t_end
        self._chained = self.scheduler.has_unfinished()
        return TwinStep(plan, produced, finished[before:])

    def _wait_until(self, end: float) -> float:
        """Sleep until the run's clock reaches `end`; when it already has (the host is late),
        count how late and return the real time instead."""
        left = end - self.now()
        if left > 0:
            self._sleep(left)
            return end
        self.lag_s -= left
        self.late_steps += 1
        return end - left
