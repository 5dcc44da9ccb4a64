"""The simulator twin: a SimPy driver of the shared core.

Three processes share one SimPy clock:
- arrivals: adds each trace request to the scheduler at its arrival time;
- the engine loop: `schedule()` -> wait the cost model's duration -> `finish(result)`, exactly the
  step protocol the real engine follows (docs/architecture.md, 'Step protocol');
- the compressor: runs each async compression batch for `compress_time(batch)` from the end of
  the step that launched it (the engine queues it behind that step's forward) while the engine
  loop keeps stepping; steps that run while a batch is in flight are stretched by the cost
  model's contention factor.

A step lasts the cost model's `step_time(plan)`, whatever its kind (prefill, decode, or a mixed
step of chunked prefill); an idle step lasts until the in-flight batch completes.

A simulator that owns its clock (`run`, one engine) runs the same three processes as one plain
loop over a heap of events instead of SimPy's (`_run_alone`): the same order of events, a
fraction of the cost per step. A router's engines share a SimPy clock (`start`, `submit`).

The simulator never decides anything itself: who runs, who is compressed into which blocks and
who is preempted all come from the plans. With sync compression its decisions are exactly the
instant driver's and the real engine's, step for step.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable

import simpy

from zipage.core.arrivals import ArrivalQueue
from zipage.core.recorder import RecordSink, Run, StepRecorder
from zipage.core.scheduler import Scheduler
from zipage.core.sequence import Sequence
from zipage.core.step import IDLE, StepPlan, StepResult
from zipage.sim.cost_model import CostModel


class Simulator:
    """One simulated engine. `run(sequences)` replays a trace on its own clock; a router
    (sim/cluster.py) instead shares one clock among several engines: it calls `start()`,
    `submit(seq)` at each arrival it routes here, and `close()` when no more will come."""

    def __init__(self, scheduler: Scheduler, cost_model: CostModel, *, check: bool = False,
                 log_decisions: bool = False, progress: bool = False,
                 env: simpy.Environment | None = None, total: int | None = None,
                 sink: RecordSink | None = None) -> None:
        self.scheduler = scheduler
        self.cost_model = cost_model
        # Only the decision log and the checker read which requests decode; a cost model and
        # the step record read how many (a list of ~100 requests a step saved).
        scheduler.decode_lists = check or log_decisions
        # `total`: requests the progress bar expects (a router that shares one clock knows it).
        self.recorder = StepRecorder(scheduler, check=check, log_decisions=log_decisions,
                                     progress=progress, total=total, keep_sequences=False,
                                     sink=sink)
        # Async scheduling (docs/architecture.md, 'Async scheduling'): each step planned while
        # the one before runs, its result applied after that plan.
        self.asynchronous = scheduler.config.async_scheduling
        # `run` then takes the plain loop, not SimPy (which alone drives the async protocol).
        self._own_clock = env is None and not self.asynchronous
        self.env = env or simpy.Environment()
        self._completed_batches: list[int] = []
        self._compression_done: simpy.Event | None = None
        self._compression_ends_at = 0.0
        self._request_arrived: simpy.Event | None = None
        self._closed = False  # no more requests will be submitted

    def run(self, sequences: Iterable[Sequence], in_arrival_order: bool = False,
            users: int | None = None) -> Run:
        """Replay `sequences`; an iterator already `in_arrival_order` is read lazily, one
        request at its arrival, so requests not yet arrived take no memory. A session's next
        turn arrives when its predecessor has finished, and with `users` a session when a
        user is free (zipage/core/arrivals.py)."""
        arrivals = ArrivalQueue(sequences, ordered=in_arrival_order, users=users)
        self.recorder.follow(arrivals)
        if self._own_clock:
            _PlainClock(self).run(arrivals)
        else:
            engine = self.start()
            self.env.process(self._arrivals(arrivals))
            self.env.run(until=engine)
        run = self.result()
        run.late_turns = arrivals.late
        return run

    def start(self) -> simpy.Process:
        loop = self._engine_loop_async if self.asynchronous else self._engine_loop
        return self.env.process(loop())

    def submit(self, seq: Sequence) -> bool:
        """A request arrives now; False if the core rejected it."""
        accepted = self.recorder.add(seq)
        self._wake()
        return accepted

    add = submit  # as an `ArrivalQueue`'s sink

    def refuse(self, seq: Sequence, reason: str) -> None:
        self.recorder.refuse(seq, reason)

    def close(self) -> None:
        self._closed = True
        self._wake()

    @property
    def load(self) -> int:
        """Requests queued or running: what a least-loaded router compares."""
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    def result(self) -> Run:
        return self.recorder.result()

    # ---- processes ----

    def _arrivals(self, arrivals: ArrivalQueue):
        yield from feed(self.env, arrivals, self)
        self.close()

    def _wake(self) -> None:
        if self._request_arrived is not None:
            self._request_arrived.succeed()
            self._request_arrived = None

    def _engine_loop(self):
        recorder = self.recorder
        while True:
            plan = recorder.schedule()
            if plan is None:
                if self._closed:
                    return
                self._request_arrived = self.env.event()
                yield self._request_arrived
                continue
            t_start = self.env.now
            # Priced before a batch it launches is set going: that batch does not overlap it.
            step_time = 0.0 if plan.kind == IDLE else self._step_time(plan, t_start)
            if plan.compress_launch is not None:
                self._launch_batch(plan, t_start, step_time)
            if plan.kind == IDLE:
                yield self._compression_done
            else:
                yield self.env.timeout(step_time)
            result = StepResult(step_id=plan.step_id, t_start=t_start, t_end=self.env.now,
                                completed_batches=self._completed_batches)
            self._completed_batches = []
            recorder.finish(plan, result)

    def _engine_loop_async(self):
        """The engine's async loop (zipage/engine/loop.py, `_step_async`) on the SimPy clock:
        advance the running step, plan the next and launch it behind the running one, then wait
        for the running step's end and settle it. An idle plan waits for the step before and
        then for its batch, and is settled at once. The host's planning overlaps the device's
        step: a step lasts what the cost model prices it, back to back."""
        recorder, env = self.recorder, self.env
        running = None  # launched, not settled: (plan, planned at, start, end, planned early)
        while True:
            t_plan = env.now
            if running is not None:
                recorder.advance()
            plan = recorder.schedule()
            early = running is not None
            if plan is None:
                if running is not None:
                    yield from self._settle(*running)
                    running = None
                    continue
                if self._closed:
                    return
                self._request_arrived = env.event()
                yield self._request_arrived
                continue
            if plan.kind == IDLE:
                if running is not None:
                    yield from self._settle(*running)
                    running = None
                t_start = env.now
                if plan.compress_launch is not None:  # a lone compression: nothing else to run
                    self._launch_batch(plan, t_start, 0.0)
                yield self._compression_done
                recorder.advance()
                recorder.settle(plan, self._result(plan, t_start, t_plan, early, late=False))
                continue
            t_start = running[3] if running is not None else t_plan
            step_time = self._step_time(plan, t_start)
            if plan.compress_launch is not None:
                self._launch_batch(plan, t_start, step_time)
            launched = (plan, t_plan, t_start, t_start + step_time, early)
            if running is not None:
                # A batch the new step launched is not the settled step's to report done.
                yield from self._settle(*running, poll=plan.compress_launch is None)
            running = launched

    def _launch_batch(self, plan: StepPlan, t_start: float, step_time: float) -> None:
        """`plan`'s batch, set going: the engine launches a batch behind its step's forward and
        the batch's stream waits for that forward, so it starts when the step ends. The step
        starts at `t_start`: now, or under async scheduling when the running step ends."""
        self._compression_done = self.env.event()
        duration = self.cost_model.compress_time(plan.compress_launch.jobs)
        self._compression_ends_at = t_start + step_time + duration
        # (t_start - now is 0.0 for a step starting now: the delay is step_time + duration,
        # bit for bit what `_PlainClock` adds to now.)
        self.env.process(self._compress(plan.compress_launch.batch_id,
                                        (t_start - self.env.now) + step_time + duration))

    def _settle(self, plan: StepPlan, t_plan: float, t_start: float, t_end: float,
                early: bool, poll: bool = True):
        """Wait for a launched step's end, then settle it with the batches done by then."""
        if t_end > self.env.now:
            yield self.env.timeout(t_end - self.env.now)
        result = self._result(plan, t_start, t_plan, early, late=True, poll=poll)
        self.recorder.settle(plan, result)

    def _result(self, plan: StepPlan, t_start: float, t_plan: float, early: bool, late: bool,
                poll: bool = True) -> StepResult:
        completed = []
        if poll:
            completed, self._completed_batches = self._completed_batches, []
        return StepResult(plan.step_id, t_start, self.env.now, completed, set(), t_plan, early,
                          late)

    def _compress(self, batch_id: int, done_in: float):
        yield self.env.timeout(done_in)
        self._completed_batches.append(batch_id)
        self._compression_done.succeed()

    def _step_time(self, plan: StepPlan, now: float) -> float:
        return step_duration(self.cost_model, plan, now, self._compression_ends_at)


def step_duration(cost: CostModel, plan: StepPlan, now: float,
                  compression_ends_at: float) -> float:
    """A step's duration from `now`: the cost model's `step_time`, the part of it that runs
    beside an async compression batch (in flight until `compression_ends_at`) stretched by the
    cost model's contention factor. Every clock prices a step here (the live twin too,
    sim/live.py); `_PlainClock` inlines it."""
    duration = cost.step_time(plan)
    overlap = compression_ends_at - now
    if overlap > 0 and duration > 0:
        duration *= cost.decode_contention(min(1.0, overlap / duration))
    return duration


def feed(env: simpy.Environment, arrivals: ArrivalQueue, sink):
    """A SimPy process handing `arrivals` to `sink` as they come due (one engine's, or a
    router's in front of several), until none is left."""
    woken: list[simpy.Event] = []

    def wake() -> None:  # a finish made a session's next turn due: look again
        if woken and not woken[-1].triggered:
            woken[-1].succeed()

    arrivals.on_change = wake
    while True:
        arrivals.admit_due(sink, env.now)
        if not arrivals.has_pending:
            return
        due = arrivals.next_arrival_s
        if not arrivals.waits_for_finishes:  # nothing can come due before `due`
            yield env.timeout(due - env.now)
            continue
        woken[:] = [env.event()]
        yield woken[0] if due is None else env.timeout(due - env.now) | woken[0]


_NO_STOPS: frozenset[str] = frozenset()

# What `_PlainClock`'s events wake: the arrival process, the engine loop (a step ended, or it was
# woken by an arrival or by the batch its idle step waits for), the compressor.
_ARRIVAL, _ENGINE, _BATCH_DONE = range(3)
# What the engine loop waits for.
_STEP, _REQUEST, _BATCH, _WOKEN, _ENDED = range(5)


class _PlainClock:
    """`Simulator.run` without SimPy: the arrival process, the engine loop and the compressor
    above, as one loop over a heap of (time, order, what it wakes, batch id).

    It keeps SimPy's order of events exactly - by time, then by the order they were scheduled
    in, a process's wake-up (SimPy's `succeed`) scheduled at the present time behind everything
    already due - and computes every time as SimPy does (now + delay), so the run is the SimPy
    run, step for step and bit for bit (tests/test_simulator.py compares them). What it saves
    is SimPy's event objects, callbacks and generator switches: about a third of the loop's
    own cost per step."""

    def __init__(self, simulator: Simulator) -> None:
        self.sim = simulator
        self.events: list[tuple[float, int, int, int]] = []
        self.order = itertools.count()
        self.now: float = 0  # SimPy's clock starts at the int 0 (a first t_start reads "0")
        self.engine = _REQUEST
        self.step: tuple[StepPlan, float] | None = None  # the plan being executed, its start
        self.arrival_at: float | None = None  # when the arrival process wakes next
        self.result = StepResult(-1, 0.0, 0.0, [], _NO_STOPS)  # the step's, refilled each step

    def run(self, arrivals: ArrivalQueue) -> None:
        self.arrivals = arrivals
        arrivals.on_change = self._next_arrival  # a finish made a session's next turn due
        self._engine()  # the engine loop starts first, then the arrivals (as in `run`)
        self._arrive()
        events, pop = self.events, heapq.heappop
        while self.engine != _ENDED:
            self.now, _, wakes, batch_id = pop(events)
            if wakes == _ENGINE:
                self._engine()
            elif wakes == _ARRIVAL:
                if self.now == self.arrival_at:  # (else superseded by an earlier due time)
                    self._arrive()
            else:  # `Simulator._compress`
                self.sim._completed_batches.append(batch_id)
                if self.engine == _BATCH:
                    self._wake()

    def _at(self, time: float, wakes: int, batch_id: int = -1) -> None:
        heapq.heappush(self.events, (time, next(self.order), wakes, batch_id))

    def _wake(self) -> None:
        """The engine loop resumes now, behind the events already due now."""
        self.engine = _WOKEN
        self._at(self.now, _ENGINE)

    # The arrival queue's sink: `Simulator.submit`, and its refusal.
    def add(self, seq: Sequence) -> bool:
        accepted = self.sim.recorder.add(seq)
        if self.engine == _REQUEST:
            self._wake()
        return accepted

    def refuse(self, seq: Sequence, reason: str) -> None:
        self.sim.recorder.refuse(seq, reason)

    def _arrive(self) -> None:
        """`Simulator._arrivals` from where it waited: every request due by now arrives; then it
        waits for the next due time."""
        self.arrival_at = None
        self.arrivals.admit_due(self, self.now)
        self._next_arrival()

    def _next_arrival(self) -> None:
        arrivals, now = self.arrivals, self.now
        if not arrivals.has_pending:
            if not self.sim._closed:
                self.sim._closed = True
                if self.engine == _REQUEST:
                    self._wake()
            return
        due = arrivals.next_arrival_s
        if due is None:
            return
        at = now + (due - now)  # as SimPy computes a timeout's time
        if self.arrival_at is None or at < self.arrival_at:
            self.arrival_at = at
            heapq.heappush(self.events, (at, next(self.order), _ARRIVAL, -1))  # `_at`, inline

    def _engine(self) -> None:
        """`Simulator._engine_loop` from where it waited: finish the step that ended, then plan
        steps until one takes time (or nothing is left to do)."""
        sim, now = self.sim, self.now
        recorder, cost = sim.recorder, sim.cost_model
        if self.step is not None:
            plan, t_start = self.step
            self.step = None
            # One result refilled every step, not one made (a call of a class with a Python
            # __init__ costs ~2,000 instructions): `finish` reads it and keeps nothing of it. Its
            # `stopped` stays the one shared empty set (the simulator never stops a request).
            result = self.result
            result.step_id, result.t_start, result.t_end = plan.step_id, t_start, now
            result.completed_batches = sim._completed_batches
            sim._completed_batches = []
            recorder.finish(plan, result)
        plan = recorder.schedule()
        if plan is None:
            self.engine = _ENDED if sim._closed else _REQUEST
            return
        idle = plan.kind == IDLE
        if idle:
            step_time = 0.0
        else:  # `Simulator._step_time`, inline: once a step
            step_time = cost.step_time(plan)
            overlap = sim._compression_ends_at - now
            if overlap > 0 and step_time > 0:
                step_time *= cost.decode_contention(min(1.0, overlap / step_time))
        self.step = (plan, now)
        if idle:
            self.engine = _BATCH
        else:
            self.engine = _STEP
            heapq.heappush(self.events,  # `_at`, inline: once a step
                           (now + step_time, next(self.order), _ENGINE, -1))
        launch = plan.compress_launch
        if launch is not None:  # scheduled behind the step's end, as SimPy orders them
            duration = cost.compress_time(launch.jobs)
            sim._compression_ends_at = now + step_time + duration
            self._at(now + (step_time + duration), _BATCH_DONE, launch.batch_id)
