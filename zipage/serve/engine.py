"""The engine loop on a background thread, fed from asyncio: what lets the server accept requests
while the engine runs.

The HTTP side (an asyncio event loop) hands requests and aborts to the engine thread through a
thread-safe queue; the engine thread applies them between steps (`EngineLoop.add` / `abort`: the
core is never touched mid-step), runs `EngineLoop.step()`, and publishes each step's tokens back
to the event loop with one `call_soon_threadsafe` per step. Each request reads its tokens from its
own `asyncio.Queue`. A thread (not a process) keeps the hand-over a function call; the GIL is
released while the GPU computes, which is most of a step.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from dataclasses import dataclass, field

from zipage.core.sequence import Sequence
from zipage.engine.llm import Engine
from zipage.engine.loop import EngineLoop, StepOutput
from zipage.serve.metrics import ServerMetrics


@dataclass
class Delta:
    """New tokens of one request from one step; `finish_reason` once it ended ("stop" at an
    end-of-sequence token, "length" at max tokens), `error` if it failed (rejected, engine died)."""

    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class RequestHandle:
    """The asyncio side of one request: its sequence and the queue its deltas arrive on."""

    seq: Sequence
    deltas: asyncio.Queue = field(default_factory=asyncio.Queue)
    done: bool = False  # the engine reported the end (or the request was aborted)
    waiting: bool = True  # no token yet (counts against the server's --max-waiting)


class EngineStopped(RuntimeError):
    """The engine thread is gone (it was shut down or hit a bug); nothing more can be served."""


class AsyncEngine:
    def __init__(self, engine: Engine, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.loop = EngineLoop(engine.new_scheduler(), engine.runner,
                               eos_token_ids=eos_token_ids(engine.tokenizer))
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._handles: dict[str, RequestHandle] = {}  # engine thread only
        self._ids = itertools.count()
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.error: str | None = None  # why the engine thread died, if it did
        # Requests handed in that have no token yet (event loop thread only).
        self.num_waiting = 0

    # ---------------------------------------------------------------- the asyncio side

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will read the tokens."""
        self._event_loop = asyncio.get_running_loop()
        self.loop.start()
        self._thread = threading.Thread(target=self._run, name="zipage-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def new_sequence(self, prompt_token_ids: list[int], sampling) -> Sequence:
        """A request arriving now (its TTFT counts from here)."""
        return Sequence(f"req-{next(self._ids)}", prompt_token_ids, sampling.max_tokens,
                        arrival_s=self.loop.now(), sampling=sampling)

    def rejection_reason(self, seq: Sequence) -> str | None:
        """Why the core would reject the request (pure: reads only the configuration)."""
        return self.loop.scheduler.rejection_reason(seq)

    def submit(self, seq: Sequence) -> RequestHandle:
        if not self.alive:
            raise EngineStopped(self.error or "the engine is not running")
        handle = RequestHandle(seq)
        self.num_waiting += 1
        self._commands.put(("add", handle))
        return handle

    def abort(self, handle: RequestHandle, finish_reason: str | None = None) -> None:
        """Drop the request and free its blocks (between two steps): its client went away, or
        (`finish_reason` "stop") its text reached a stop string."""
        self._started(handle)
        if not handle.done:
            handle.done = True
            self._commands.put(("abort", handle.seq.seq_id, finish_reason))

    def _started(self, handle: RequestHandle) -> None:
        if handle.waiting:
            handle.waiting = False
            self.num_waiting -= 1

    def _receive(self, deliveries: list[tuple[RequestHandle, Delta]]) -> None:
        """On the event loop: hand each delta to its request."""
        for handle, delta in deliveries:
            self._started(handle)
            handle.deltas.put_nowait(delta)

    # ---------------------------------------------------------------- the engine thread

    def _run(self) -> None:
        try:
            while self._apply_commands(wait=not self.loop.scheduler.has_unfinished()):
                output = self.loop.step()
                if output is not None:
                    self._publish(output)
        except BaseException as error:  # a bug: fail every request loudly, keep the message
            self.error = f"engine stopped: {type(error).__name__}: {error}"
            self._fail_all(self.error)
            raise

    def _apply_commands(self, wait: bool) -> bool:
        """Apply queued adds and aborts; wait for one when idle. False once told to stop."""
        while True:
            try:
                command = self._commands.get() if wait else self._commands.get_nowait()
            except queue.Empty:
                return True
            wait = False
            if command[0] == "stop":
                self._fail_all("the server is shutting down")
                return False
            if command[0] == "add":
                self._add(command[1])
            else:
                self._abort(*command[1:])

    def _add(self, handle: RequestHandle) -> None:
        seq = handle.seq
        if not self.loop.add(seq):
            self.loop.tokens.pop(seq.seq_id, None)
            self._deliver([(handle, Delta([], "error", seq.error))])
            return
        self._handles[seq.seq_id] = handle

    def _abort(self, seq_id: str, finish_reason: str | None) -> None:
        if self._handles.pop(seq_id, None) is None:
            return  # already finished
        self.loop.abort(seq_id)
        self.loop.tokens.pop(seq_id, None)
        if self.metrics is not None:
            if finish_reason is None:
                self.metrics.aborted.inc()
            else:
                self.metrics.finished_request(finish_reason)
            self.metrics.update_gauges(self.loop.scheduler)
        self._forget_history()

    def _publish(self, output: StepOutput) -> None:
        finished = {seq.seq_id: seq for seq in output.finished}
        deliveries = []
        for seq, token in output.tokens:
            handle = self._handles.get(seq.seq_id)
            if handle is None:
                continue  # aborted while the step ran
            reason = None
            if seq.seq_id in finished:
                eos = token in self.loop.eos_token_ids and not seq.sampling.ignore_eos
                reason = "stop" if eos else "length"
                if self.metrics is not None:
                    self.metrics.finished_request(reason)
                del self._handles[seq.seq_id]
                self.loop.tokens.pop(seq.seq_id, None)
            deliveries.append((handle, Delta([token], reason)))
        if deliveries:
            self._deliver(deliveries)
        if self.metrics is not None:
            self.metrics.record_step(output, self.loop.scheduler)
        self._forget_history()

    def _forget_history(self) -> None:
        """A server runs for days: keep no per-step records or finished requests around (the
        offline loop keeps them for its `Run`; /metrics has the aggregates)."""
        scheduler = self.loop.scheduler
        scheduler.finished.clear()
        scheduler.aborted.clear()
        scheduler.rejected.clear()
        scheduler.admission_order.clear()
        self.loop.recorder.metrics.steps.clear()

    def _fail_all(self, message: str) -> None:
        handles, self._handles = list(self._handles.values()), {}
        self._deliver([(handle, Delta([], "error", message)) for handle in handles])
        while True:  # requests handed in but never added
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add":
                self._deliver([(command[1], Delta([], "error", message))])

    def _deliver(self, deliveries: list[tuple[RequestHandle, Delta]]) -> None:
        if deliveries and self._event_loop is not None and not self._event_loop.is_closed():
            self._event_loop.call_soon_threadsafe(self._receive, deliveries)


def eos_token_ids(tokenizer) -> frozenset[int]:
    """The tokenizer's end-of-sequence ids (none for models without a tokenizer)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, (list, tuple)) else [eos])
