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

The simulator never decides anything itself: who runs, who is compressed into which blocks and
who is preempted all come from the plans. With sync compression its decisions are exactly the
instant driver's and the real engine's, step for step.
"""

from __future__ import annotations

from collections.abc import Iterable

import simpy

from zipage.core.recorder import RecordSink, Run, StepRecorder
from zipage.core.scheduler import Scheduler
from zipage.core.sequence import Sequence
from zipage.core.step import IDLE, StepPlan, StepResult

from .cost_model import CostModel


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
        # `total`: requests the progress bar expects (a router that shares one clock knows it).
        self.recorder = StepRecorder(scheduler, check=check, log_decisions=log_decisions,
                                     progress=progress, total=total, keep_sequences=False,
                                     sink=sink)
        self.env = env or simpy.Environment()
        self._completed_batches: list[int] = []
        self._compression_done: simpy.Event | None = None
        self._compression_ends_at = 0.0
        self._request_arrived: simpy.Event | None = None
        self._closed = False  # no more requests will be submitted

    def run(self, sequences: Iterable[Sequence], in_arrival_order: bool = False) -> Run:
        """Replay `sequences`; an iterator already `in_arrival_order` is read lazily, one
        request at its arrival, so requests not yet arrived take no memory."""
        arrivals = sequences if in_arrival_order else sorted(sequences,
                                                             key=lambda seq: seq.arrival_s)
        engine = self.start()
        self.env.process(self._arrivals(arrivals))
        self.env.run(until=engine)
        return self.result()

    def start(self) -> simpy.Process:
        return self.env.process(self._engine_loop())

    def submit(self, seq: Sequence) -> None:
        """A request arrives now."""
        self.recorder.add(seq)
        self._wake()

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

    def _arrivals(self, arrivals: Iterable[Sequence]):
        for seq in arrivals:
            if seq.arrival_s > self.env.now:
                yield self.env.timeout(seq.arrival_s - self.env.now)
            self.submit(seq)
        self.close()

    def _wake(self) -> None:
        if self._request_arrived is not None:
            self._request_arrived.succeed()
            self._request_arrived = None

    def _engine_loop(self):
        recorder, cost = self.recorder, self.cost_model
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
            step_time = 0.0 if plan.kind == IDLE else self._step_time(plan)
            if plan.compress_launch is not None:
                # The engine launches a batch behind its step's forward, and the batch's stream
                # waits for that forward: it starts when the step ends.
                self._compression_done = self.env.event()
                duration = cost.compress_time(plan.compress_launch.jobs)
                self._compression_ends_at = t_start + step_time + duration
                self.env.process(self._compress(plan.compress_launch.batch_id,
                                                step_time + duration))
            if plan.kind == IDLE:
                yield self._compression_done
            else:
                yield self.env.timeout(step_time)
            result = StepResult(step_id=plan.step_id, t_start=t_start, t_end=self.env.now,
                                completed_batches=self._completed_batches)
            self._completed_batches = []
            recorder.finish(plan, result)

    def _compress(self, batch_id: int, done_in: float):
        yield self.env.timeout(done_in)
        self._completed_batches.append(batch_id)
        self._compression_done.succeed()

    def _step_time(self, plan: StepPlan) -> float:
        """The step's duration; the part of it that runs beside an async compression batch
        is stretched by the cost model's contention factor."""
        cost = self.cost_model
        duration = cost.step_time(plan)
        overlap = self._compression_ends_at - self.env.now
        if overlap > 0 and duration > 0:
            duration *= cost.decode_contention(min(1.0, overlap / duration))
        return duration
