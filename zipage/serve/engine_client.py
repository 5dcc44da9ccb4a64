"""The HTTP process's side of the engine process (`zipage.serve.engine_process`).

`EngineClient.start` spawns the engine process and blocks until its model is loaded, before the
server listens; a bad model file raises the child's one-line `ZipageError` here. Once the event
loop runs, `attach` hands the socket to an `EngineChannel` (zipage/serve/channel.py): each
`StepUpdate` is read on the event loop (one message per engine step, however many requests it
carries, reassembled however its bytes arrive) and each request's tokens go to its own
`asyncio.Queue`. Requests and aborts go out as they come (`submit`, `abort`), never blocking the
loop. If the engine process dies, every request in flight gets an error and a new engine process
is started from the same `Setup` (new requests get 503 and /health is unhealthy until it is
ready), and `on_restarted` is told (a router forgets what it routed there). More than
`max_restarts` restarts within `RESTART_WINDOW_S` call `on_fatal`: the server exits, for a
supervisor to restart it whole.

Latency metrics are measured here, on receipt: arrival is when the request reached the server,
so TTFT and TPOT include everything between the client and the engine.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from zipage.core.admission import Admission
from zipage.core.routing import ReplicaLoad
from zipage.errors import ZipageError
from zipage.serve.channel import EngineChannel
from zipage.serve.metrics import ServerMetrics
from zipage.serve.wire import IDLE, Abort, Add, EngineFailed, Ready, Setup, StartupFailed, StepUpdate, Stop

RESTART_WINDOW_S = 600.0  # --max-engine-restarts counts the restarts within this many seconds
STOP_TIMEOUT_S = 30.0  # a step in flight finishes and tensor-parallel ranks leave their group
# (up to 15 s: zipage/engine/parallel.py) first; an engine process stuck longer is killed


class EngineStopped(RuntimeError):
    """No engine process can take the request now: the server is stopping, or its engine process
    died (and a new one is starting, or none will)."""


class EngineProcessError(RuntimeError):
    """The engine process failed while starting, not because of the user's input."""


@dataclass
class Delta:
    """New tokens of one request from one step; `finish_reason` once it ended ("stop" at an
    end-of-sequence token, "length" at max tokens); `error` and its HTTP `status` if it failed
    (400: the core refused it; 503: the engine stopped)."""

    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    status: int = 500
    logprobs: list | None = None  # beside token_ids, if the request asked for them
    # On the request's first token: its prompt tokens found in the prefix cache, and its
    # seconds in the engine's queue. They ride on the delta, not the handle, so that they reach
    # the app through Ray's replicas too.
    cached_tokens: int | None = None
    queued_s: float | None = None
    param: str | None = None  # beside `error`: the request field at fault, where one is


@dataclass
class RequestHandle:
    """The asyncio side of one request: the queue its deltas arrive on, and its timings."""

    seq_id: str
    prompt_len: int
    arrival_s: float
    replica: int = 0  # the engine process it went to (`--data-parallel`)
    deltas: asyncio.Queue = field(default_factory=asyncio.Queue)
    done: bool = False  # ended, failed or aborted: nothing more arrives
    waiting: bool = True  # no token yet and not ended (counts against --max-waiting)
    first_token_s: float | None = None
    last_token_s: float | None = None  # when its latest token arrived (inter-token latency)
    num_tokens: int = 0
    # Seconds in the engine's queue before its first admission (None: not admitted yet, or a
    # forked sample, which never queues for a prefill of its own).
    queued_s: float | None = None
    # Its prompt tokens found in the prefix cache, known when it is admitted (a chunked
    # prompt's first token comes steps later).
    cached_tokens: int = 0
    # Prompt log-probabilities (`SamplingParams.prompt_logprobs`), complete before the first
    # token arrives: one entry per prompt token, None for the first.
    prompt_logprobs: list = field(default_factory=list)


class EngineClient:
    def __init__(self, process: subprocess.Popen, connection: Connection, info: Ready,
                 setup: Setup | None = None, max_restarts: int = 0, index: int = 0) -> None:
        self.index = index  # which replica this engine process is (`--data-parallel`)
        self.label = ""  # "replica 1: " in the log lines of one of several
        self.process = process
        self.connection = connection
        self.info = info
        self.setup = setup  # to start a new engine process if this one dies
        self.max_restarts = max_restarts
        self.on_fatal: Callable[[], None] | None = None  # the engine cannot be kept up
        # A new engine process replaced a dead one: its caches start empty (a router forgets
        # what it had routed there).
        self.on_restarted: Callable[[], None] | None = None
        self.fatal: str | None = None  # why, once it could not
        self._restarts: collections.deque[float] = collections.deque()  # when (monotonic)
        self._restart: asyncio.Task | None = None
        self._closing = False
        self._died = ""  # why the latest engine process stopped
        # The core's admission rule, asked before a request is sent (pure: the configuration).
        self.admission = Admission(info.config, info.capacity.num_blocks)
        self.metrics: ServerMetrics | None = None
        self.error: str | None = None  # why the engine stopped, once it did
        self.num_waiting = 0  # requests sent that have no token yet
        self.stats = IDLE  # the scheduler after the engine's latest step (its KV use, ...)
        self._handles: dict[str, RequestHandle] = {}
        self._ids = itertools.count()
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._channel: EngineChannel | None = None  # the socket on the loop, once attached

    # ---------------------------------------------------------------- starting and stopping

    @classmethod
    def start(cls, setup: Setup, max_restarts: int = 0, index: int = 0) -> "EngineClient":
        """Spawn the engine process and wait until it has built the engine; up to
        `max_restarts` new ones within `RESTART_WINDOW_S` if it dies later."""
        return cls(*_spawn(setup), setup, max_restarts, index)

    def attach(self, metrics: ServerMetrics | None = None) -> None:
        """Start reading the engine's updates on the running event loop."""
        self.metrics = metrics
        self._event_loop = asyncio.get_running_loop()
        if self.alive:
            self._open_channel()

    def close(self, reason: str = "the server is shutting down") -> None:
        """On the event loop: tell the engine to stop, stop reading, fail what is in flight
        (with `reason`, and a 503); no restart after this."""
        self._closing = True
        self.error = self.error or reason
        if not self.connection.closed and self.process.poll() is None:
            self._send(Stop())
        self._detach()
        self._fail_all(self.error)

    def stop_process(self) -> None:
        """Wait for the engine process to exit (told to stop first; killed if it hangs).
        Blocking; safe to call more than once, and after `close`."""
        stopping = self.process.poll() is None
        self._send_stop()
        if not self.connection.closed:
            self.connection.close()
        code = _reap(self.process, STOP_TIMEOUT_S)
        if stopping and code != 0:  # it was told to stop: anything but 0 is worth a line
            print(f"zipage serve: the engine process exited with code {code} while stopping",
                  file=sys.stderr, flush=True)

    def _send_stop(self) -> None:
        """Off the event loop (`stop_process`): a message this small always fits the socket."""
        if not self.connection.closed and self.process.poll() is None:
            try:
                self.connection.send(Stop())
            except OSError:
                pass

    @property
    def alive(self) -> bool:
        return self.error is None and self.process.poll() is None

    @property
    def pid(self) -> int:
        return self.process.pid

    def load(self) -> ReplicaLoad:
        """What a router compares (`zipage.core.routing`): the requests sent here and not ended
        (the simulator's queued or running), and the KV blocks its latest step reported."""
        return ReplicaLoad(len(self._handles), self.stats.blocks_used)

    # ---------------------------------------------------------------- requests

    def submit(self, prompt_token_ids: list[int], sampling) -> list[RequestHandle]:
        """Send a request to the engine; it arrives now (its TTFT counts from here). One handle
        per sample (`sampling.n`): each is a request of its own to the engine, the others
        forked from the first."""
        if not self.alive:
            raise EngineStopped(self.error or "the engine is not running")
        now = time.perf_counter()
        first = f"req-{next(self._ids)}"
        handles = [RequestHandle(first if index == 0 else f"{first}#{index}",
                                 len(prompt_token_ids), now, self.index)
                   for index in range(sampling.n)]
        self._send(Add(first, prompt_token_ids, sampling,
                       [handle.seq_id for handle in handles[1:]]))
        if not self.alive:
            raise EngineStopped(self.error)
        for handle in handles:
            self._handles[handle.seq_id] = handle
        self.num_waiting += len(handles)
        return handles

    def abort(self, handle: RequestHandle, finish_reason: str | None = None) -> None:
        """Drop the request (the engine frees its blocks before its next step): its client went
        away, or (`finish_reason` "stop") its text reached a stop string. A no-op once the
        request ended."""
        if handle.done:
            return
        self._end(handle)
        if self.metrics is not None:
            if finish_reason is None:
                self.metrics.aborted.inc()
            else:
                self.metrics.finished_request(handle, finish_reason, time.perf_counter())
        if self.alive:
            self._send(Abort(handle.seq_id))

    # ---------------------------------------------------------------- the engine's updates

    def _send(self, message) -> None:
        """To the engine, without waiting (a socket that failed reaches `_engine_gone`)."""
        if self._channel is not None:
            self._channel.send(message)
            return
        try:  # not attached: the socket is still blocking
            self.connection.send(message)
        except OSError:
            self._engine_gone()

    def _open_channel(self) -> None:
        self._channel = EngineChannel(self.connection.fileno(), self._event_loop,
                                      self._dispatch, self._engine_gone)

    def _dispatch(self, message) -> None:
        """One whole message from the engine process."""
        if isinstance(message, StepUpdate):
            self._receive(message)
        elif isinstance(message, EngineFailed):
            self.error = message.message

    def _receive(self, update: StepUpdate) -> None:
        now = time.perf_counter()
        metrics = self.metrics
        handles = self._handles
        for seq_id, (position, entries) in update.prompt_logprobs.items():
            handle = handles.get(seq_id)
            if handle is not None:
                del handle.prompt_logprobs[position:]  # a prompt chunk computed again
                handle.prompt_logprobs.extend(entries)
        # Admissions before tokens: a prompt computed in one chunk samples in its admission's step.
        for seq_id, cached in update.prefix_hits.items():
            handle = handles.get(seq_id)
            if handle is not None:
                handle.cached_tokens = cached
        for seq_id, seconds in update.queued.items():
            handle = handles.get(seq_id)
            if handle is not None:
                handle.queued_s = seconds
        logprobs = update.logprobs
        gaps: dict[float, int] = {}  # inter-token latency -> tokens (`inter_token_latencies`)
        for index, (seq_id, token) in enumerate(zip(update.seq_ids, update.tokens)):
            handle = handles.get(seq_id)
            if handle is None:
                continue  # aborted while the step ran
            handle.num_tokens += 1
            cached = queued = None
            if handle.first_token_s is None:
                handle.first_token_s = now
                cached, queued = handle.cached_tokens, handle.queued_s
                self._started(handle)
                if metrics is not None:
                    metrics.first_token(handle)
            elif metrics is not None:  # one observation per token after the first
                gap = now - handle.last_token_s
                gaps[gap] = gaps.get(gap, 0) + 1
            handle.last_token_s = now
            reason = update.finished.get(seq_id)
            if reason is not None:
                self._end(handle)
                if metrics is not None:
                    metrics.finished_request(handle, reason, now)
            handle.deltas.put_nowait(Delta([token], reason, logprobs=None if logprobs is None
                                           else [logprobs[index]], cached_tokens=cached,
                                           queued_s=queued))
        for seq_id, (message, param) in update.rejected.items():
            handle = handles.get(seq_id)
            if handle is not None:
                self._end(handle)
                handle.deltas.put_nowait(Delta([], None, message, 400, param=param))
        self.stats = update.stats
        if metrics is not None:
            metrics.inter_token_latencies(gaps)
            metrics.engine_stats(update.stats, len(update.tokens))

    def _end(self, handle: RequestHandle) -> None:
        handle.done = True
        self._handles.pop(handle.seq_id, None)
        self._started(handle)

    def _started(self, handle: RequestHandle) -> None:
        if handle.waiting:
            handle.waiting = False
            self.num_waiting -= 1

    def _engine_gone(self) -> None:
        """The socket closed: the engine process exited (or was killed). Fail what it had, and
        start a new one unless the server is stopping."""
        self._detach()
        if self.error is None:
            try:  # the socket closes as the process exits: its code is due at once
                code = self.process.wait(timeout=1.0)
            except subprocess.TimeoutExpired:  # never hold the event loop long; shutdown reaps
                code = "unknown"
            self.error = f"the engine process stopped (exit code {code})"
        self._died = self.error
        self.stats = IDLE
        if self.metrics is not None:
            self.metrics.engine_down()
        if (self._closing or self.setup is None or self._restart is not None
                or self._event_loop is None):
            self._fail_all(self.error)
            return
        refused = self._count_restart()
        if refused is not None:
            self._fail_all(self.error)
            self._give_up(refused)
            return
        self.error += "; the server is restarting it: retry the request"
        self._fail_all(self.error)
        self._restart = self._event_loop.create_task(self._restart_engine())

    # ---------------------------------------------------------------- restarting

    async def _restart_engine(self) -> None:
        print(f"zipage serve: {self.label}{self._died}; starting a new one (restart {len(self._restarts)} "
              f"of at most {self.max_restarts} within {RESTART_WINDOW_S:.0f} s: "
              "--max-engine-restarts)", file=sys.stderr, flush=True)
        try:
            started = await asyncio.to_thread(self._spawn_unless_closing)
        except (ZipageError, EngineProcessError) as error:
            self._give_up(f"a new engine process failed to start: {error}")
        else:
            if started is not None:
                self._swap(*started)
        finally:
            self._restart = None

    def _count_restart(self) -> str | None:
        """Count a restart now; or why none is allowed (--max-engine-restarts within the
        window)."""
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > RESTART_WINDOW_S:
            self._restarts.popleft()
        if len(self._restarts) >= self.max_restarts:
            return (f"{self._died}, after {len(self._restarts)} restart"
                    f"{'s' * (len(self._restarts) != 1)} within {RESTART_WINDOW_S:.0f} s "
                    f"(--max-engine-restarts {self.max_restarts}); the server exits so that "
                    "its supervisor can restart it")
        self._restarts.append(now)
        return None

    def _spawn_unless_closing(self):
        """Thread: reap the dead process, start a new one; None (and it stopped) if the server
        began shutting down meanwhile."""
        _reap(self.process, timeout=0)
        process, connection, info = _spawn(self.setup)
        if not self._closing:
            return process, connection, info
        try:
            connection.send(Stop())
        except OSError:
            pass
        connection.close()
        _reap(process, STOP_TIMEOUT_S)
        return None

    def _swap(self, process: subprocess.Popen, connection: Connection, info: Ready) -> None:
        """On the event loop: serve from the new engine process."""
        self.process, self.connection, self.info = process, connection, info
        self.error = None
        if self.metrics is not None:
            self.metrics.engine_restarted()
        if self.on_restarted is not None:
            self.on_restarted()
        self._open_channel()
        print(f"zipage serve: {self.label}engine process {process.pid} is ready", file=sys.stderr,
              flush=True)

    def _give_up(self, reason: str) -> None:
        self.error = self.fatal = reason
        print(f"zipage serve: error: {self.label}{reason}", file=sys.stderr, flush=True)
        if self.on_fatal is not None:
            self.on_fatal()

    def _detach(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if not self.connection.closed:
            self.connection.close()

    def _fail_all(self, message: str) -> None:
        for handle in list(self._handles.values()):
            self._end(handle)
            handle.deltas.put_nowait(Delta([], None, message, 503))


def _spawn(setup: Setup) -> tuple[subprocess.Popen, Connection, Ready]:
    """Start an engine process and wait until it has built the engine."""
    ours, theirs = socket.socketpair()
    env = None
    if setup.visible_devices is not None:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": setup.visible_devices}
    process = subprocess.Popen(
        [sys.executable, "-m", "zipage.serve.engine_process", str(theirs.fileno())],
        pass_fds=(theirs.fileno(),), env=env)
    theirs.close()  # only the child holds it now: its exit reads as EOF here
    connection = Connection(ours.detach())
    try:
        connection.send(setup)
        reply = connection.recv()
    except (EOFError, OSError):
        reply = None
    except BaseException:  # Ctrl-C while the model loads
        connection.close()
        _reap(process, timeout=0)
        raise
    if isinstance(reply, Ready):
        return process, connection, reply
    connection.close()
    code = _reap(process, STOP_TIMEOUT_S)
    if isinstance(reply, StartupFailed) and reply.user_error:
        raise ZipageError(reply.message)
    if isinstance(reply, StartupFailed):
        raise EngineProcessError(f"the engine process failed while starting: "
                                 f"{reply.message} (its traceback is above)")
    raise EngineProcessError(f"the engine process exited with code {code} before it was "
                             "ready (its output is above)")


def _reap(process: subprocess.Popen, timeout: float) -> int:
    """Wait up to `timeout` s for the process to exit, then kill it; its exit code."""
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()
