"""The engine process of `zipage serve`: it owns the `Engine`, its `EngineLoop` and the scheduler.

Why a process of its own: on a thread of the server process the engine loop shared the GIL with
the HTTP event loop (request parsing, detokenization, SSE writes), and on an H200 every decode
step took ~30 % longer than offline (TPOT p50 16.8 vs 13.0 ms, docs/BENCHMARKS.md,
'Changelog'). Here the step loop runs alone on its interpreter, as `zipage replay --gpu` runs it.

`EngineClient.start` runs `python -m zipage.serve.engine_process FD` (FD: this side of a socket
pair). The process builds the engine from the `Setup` it receives and answers `Ready`, or
`StartupFailed` with the one-line error of a bad model file. Then, until told to stop: apply the
adds and aborts that arrived (between steps, never inside one), run one `EngineLoop.step()` (the
step `zipage replay --gpu` runs), send one `StepUpdate` with the step's token ids. No text here:
the HTTP process detokenizes. A thread receives commands into a queue, so the HTTP process's
writes never wait for a step to end. The process exits on `Stop`, when the HTTP process is gone
(its end of the socket closes), or when a step raises (after sending `EngineFailed`).
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import sys
import threading
import traceback
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection

from zipage.core.sampling import StructuredOutput
from zipage.core.sequence import Sequence
from zipage.errors import FieldError, ZipageError
from zipage.request_fields import copy_fields
from zipage.serve.wire import (
    Abort,
    Add,
    EngineFailed,
    EngineStats,
    Ready,
    Setup,
    StartupFailed,
    StepUpdate,
    Stop,
    refusal_words,
)


class ServerGone(Exception):
    """The HTTP process closed its end of the socket."""


@dataclass
class GrammarReady:
    """From the compile thread, into the inbox (never over the socket): the grammar `command`
    waited for is compiled, or failed (`future`)."""

    command: Add
    future: Future


def main(fd: int) -> int:
    # Ctrl-C in a terminal reaches the whole process group; the HTTP process decides when the
    # engine stops (after its in-flight streams), so the engine ignores it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    connection = Connection(fd)
    try:
        setup: Setup = connection.recv()
    except (EOFError, OSError):
        return 1
    try:
        loop, ready, close = build(setup)
    except ZipageError as error:  # the user's to fix: the HTTP process prints it in one line
        _send_quietly(connection, StartupFailed(str(error), user_error=True))
        return 2
    except Exception as error:  # a bug: keep the traceback (stderr is the server's)
        traceback.print_exc()
        _send_quietly(connection, StartupFailed(f"{type(error).__name__}: {error}",
                                                user_error=False))
        return 1
    core = EngineCore(None, connection, ready.vocab_size, loop=loop)
    try:
        connection.send(ready)
    except OSError:
        close()
        return 0
    try:
        return core.serve()
    finally:
        close()  # tensor parallel: stop the workers before the interpreter exits


def build(setup: Setup):
    """The step loop this process serves, the `Ready` describing it, and what to call on exit:
    the engine's `EngineLoop` (on the CPU the torch thread count is set before any torch work),
    or under --simulate the live twin (sim/live.py), which needs no torch."""
    if setup.cpus is not None:
        os.sched_setaffinity(0, setup.cpus)  # before torch starts its threads
    if setup.simulate is not None:
        return build_twin(setup)
    from zipage.engine.builder import build_engine

    threads = None
    if setup.device == "cpu":
        from zipage.engine.threads import set_cpu_threads

        threads = set_cpu_threads(setup.threads)  # zipage.engine.threads: why not torch's default
    engine = build_engine(setup.settings, setup.device, cuda_graphs=setup.cuda_graphs,
                          prefill_graphs=setup.prefill_graphs)
    loop = engine_loop(engine)
    ready = Ready(str(engine.device), engine.config, engine.capacity, engine.shape.vocab_size,
                  loop.eos_token_ids, threads)
    return loop, ready, engine.close


def build_twin(setup: Setup):
    """`build` under --simulate: the simulator's deployment of the same settings (model shape,
    the GPU of --hardware, capacity, the --cost-model), stepped in real time."""
    from zipage.core.deployment import run_device
    from zipage.sim.live import LiveTwin
    from zipage.sim.simulate import plan_deployment

    settings = setup.settings
    deployment = plan_deployment(settings)
    twin = LiveTwin(deployment, setup.simulate.avoid_token_ids)
    device = (f"a simulated {run_device(settings, 'simulator')} ({settings.cost_model} cost "
              "model)")
    ready = Ready(device, deployment.config, deployment.capacity, deployment.shape.vocab_size,
                  twin.eos_token_ids, None)
    return twin, ready, lambda: None


def engine_loop(engine):
    """The real engine's step loop, stopping at its tokenizer's end-of-sequence ids."""
    from zipage.engine.loop import EngineLoop
    from zipage.engine.structured import StructuredOutputs

    eos = eos_token_ids(engine.tokenizer)
    return EngineLoop(engine.new_scheduler(), engine.runner, eos_token_ids=eos,
                      structured=StructuredOutputs(engine.tokenizer, engine.shape.vocab_size, eos))


class EngineCore:
    """The step loop fed from the socket: the engine's (`engine_loop(engine)`), or `loop` (the
    live twin of --simulate, sim/live.py, which offers the same calls)."""

    def __init__(self, engine, connection: Connection, vocab_size: int, loop=None) -> None:
        self.connection = connection
        self.vocab_size = vocab_size
        self.loop = loop if loop is not None else engine_loop(engine)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.rejected: dict[str, tuple[str, str | None]] = {}
        self.changed = False  # an abort or rejection the HTTP side has no update of yet
        self.compressions = 0
        self.preemptions = 0
        self.prefix_queries = 0  # `EngineStats.prefix_query_tokens_total`
        self.prefix_hits = 0
        self.host_hits = 0  # `EngineStats.host_hit_tokens_total`
        self.step_started = 0.0  # when the latest step began (the loop's clock)
        self.queued: dict[str, float] = {}  # `StepUpdate.queued` of the step being published
        # Requests whose grammar is compiling (`_compile_first`): leader id -> its command, and
        # the ids among them aborted meanwhile.
        self.compiling: dict[str, Add] = {}
        self.aborted_compiling: set[str] = set()

    def serve(self) -> int:
        self.loop.start()
        receiver = threading.Thread(target=self._receive, name="zipage-commands", daemon=True)
        receiver.start()
        try:
            # (`busy`: under async scheduling a launched step is still to be settled)
            while self._apply(wait=not self.loop.busy):
                self.step_started = self.loop.now()  # a queue time ends where its step began
                output = self.loop.step(self.step_started)
                if output is not None or self.changed:
                    self._publish(output)
        except ServerGone:
            return 0
        except BaseException as error:
            _send_quietly(self.connection,
                          EngineFailed(f"engine stopped: {type(error).__name__}: {error}"))
            raise
        finally:
            self._stop_receiving(receiver)
        return 0

    def _stop_receiving(self, receiver: threading.Thread) -> None:
        """End the command thread before the interpreter finalizes, so no thread wakes from
        `recv` in a half torn-down interpreter (the HTTP process closes its end right after
        `Stop`). Shutting the socket down wakes the thread with an end of file, and tells the
        HTTP process at once that the engine is gone."""
        try:
            with socket.socket(fileno=os.dup(self.connection.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        receiver.join(timeout=5.0)

    def _receive(self) -> None:
        """Thread: commands into the inbox as they arrive; `Stop` once the server is gone."""
        try:
            while True:
                self.inbox.put(self.connection.recv())
        except (EOFError, OSError):
            self.inbox.put(Stop())

    def _apply(self, wait: bool) -> bool:
        """Apply the queued adds and aborts; block for one when idle. False on `Stop`."""
        while True:
            try:
                command = self.inbox.get() if wait else self.inbox.get_nowait()
            except queue.Empty:
                return True
            wait = False
            if isinstance(command, Stop):
                return False
            if isinstance(command, Add):
                self._add(command)
            elif isinstance(command, Abort):
                self._abort(command.seq_id)
            elif isinstance(command, GrammarReady):
                self._grammar_ready(command)

    def _add(self, command: Add) -> None:
        """Queue the request, or refuse it alone; one whose grammar is not compiled yet waits
        for it off the step loop first (`_compile_first`)."""
        if not self._compile_first(command):
            self._add_now(command)

    def _compile_first(self, command: Add) -> bool:
        """True when the request's grammar went to the compile thread: the request joins the
        step loop when it is ready (`_grammar_ready`), as an arrival of that moment (the core
        never sees it before), so a slow schema stalls no other request's steps."""
        spec = getattr(command.sampling, "structured_output", None)
        structured = getattr(self.loop, "structured", None)  # None: the twin (--simulate)
        if not isinstance(spec, StructuredOutput) or structured is None or structured.ready(spec):
            return False  # (a malformed spec is `_add_now`'s to refuse)
        self.compiling[command.seq_id] = command
        structured.compile_soon(spec).add_done_callback(
            lambda future: self.inbox.put(GrammarReady(command, future)))
        return True

    def _grammar_ready(self, ready: GrammarReady) -> None:
        command = self.compiling.pop(ready.command.seq_id)
        seq_ids = [command.seq_id, *command.sample_ids]
        aborted = [seq_id for seq_id in seq_ids if seq_id in self.aborted_compiling]
        self.aborted_compiling.difference_update(aborted)
        if len(aborted) == len(seq_ids):
            return
        error = ready.future.exception()
        if isinstance(error, FieldError):  # as `_add_now` refuses a spec that does not compile
            self._refuse(seq_ids, str(error), error.field)
            return
        if error is not None:
            self._refuse(seq_ids, f"the engine refused the request: {error}", None)
            return
        self._add_now(command)
        for seq_id in aborted:  # samples aborted while the grammar compiled
            self._abort(seq_id)

    def _add_now(self, command: Add) -> None:
        """Queue the request, or refuse it alone. The HTTP side validated it already; this is
        the engine's own check, because a value that reached a step (a token id outside the
        vocabulary, a top_k torch cannot hold) would raise there and stop every request. A
        refusal names its field as the HTTP side's does (`param`), where there is one."""
        seq_ids = [command.seq_id, *command.sample_ids]
        try:
            command.sampling.check()
            if len(seq_ids) != command.sampling.n:
                raise FieldError("n", f"{command.sampling.n} samples but {len(seq_ids)} ids")
            ids = command.prompt_token_ids
            if not ids or min(ids) < 0 or max(ids) >= self.vocab_size:
                raise FieldError("prompt", f"token ids must be in 0..{self.vocab_size - 1} and "
                                           "there must be at least one")
            now = self.loop.now()
            group = []
            for index, seq_id in enumerate(seq_ids):  # docs/architecture.md, 'Samples of ...'
                own = command.sampling.for_sample(index)
                seq = Sequence(seq_id, ids, own.max_tokens, arrival_s=now, sampling=own)
                copy_fields(seq, own)
                if index == 0:
                    seq.prompt_logits = own.prompt_logprobs is not None
                else:
                    seq.fork_of = group[0]
                group.append(seq)
            added = self.loop.add(group[0])  # the samples share its lengths, and its fate
            if added:
                for seq in group[1:]:
                    self.loop.add(seq)
            else:  # the HTTP side asked the same rule first: rare. Asked again for its field.
                refusal = self.loop.scheduler.admission.refusal(group[0])
                error, param = (refusal_words(refusal) if refusal is not None
                                else (group[0].error, None))
        except FieldError as failure:
            added, error, param = False, str(failure), failure.field
        except Exception as failure:  # noqa: BLE001 - whatever it is, it is this request's
            added, error, param = False, f"the engine refused the request: {failure}", None
        if not added:
            self._refuse(seq_ids, error, param)

    def _refuse(self, seq_ids: list[str], error: str, param: str | None) -> None:
        for seq_id in seq_ids:
            self.loop.tokens.pop(seq_id, None)
            self.rejected[seq_id] = (error, param)
        self.changed = True

    def _abort(self, seq_id: str) -> None:
        if any(seq_id == command.seq_id or seq_id in command.sample_ids
               for command in self.compiling.values()):
            self.aborted_compiling.add(seq_id)  # not in the loop yet: `_grammar_ready` drops it
            return
        if self.loop.abort(seq_id):  # False: it finished before the abort arrived
            self.loop.tokens.pop(seq_id, None)
            self.changed = True

    def _publish(self, output) -> None:
        seq_ids, tokens, finished = [], [], {}
        logprobs, prompt_logprobs, prefix_hits = None, {}, {}
        if output is not None:
            for seq, token in output.tokens:
                seq_ids.append(seq.seq_id)
                tokens.append(token)
            if output.logprobs:
                logprobs = [output.logprobs.get(seq_id) for seq_id in seq_ids]
            prompt_logprobs = output.prompt_logprobs
            eos = self.loop.eos_token_ids
            for seq in output.finished:
                last = self.loop.tokens.pop(seq.seq_id)[-1]
                stopped = last in eos and not seq.sampling.ignore_eos
                finished[seq.seq_id] = "stop" if stopped else "length"
            for plan in output.plans:  # (async scheduling: a step counts once, when settled)
                self.compressions += len(plan.compressions)
                self.preemptions += len(plan.preempted)
                if plan.prefill:
                    prefix_hits.update(self._count_prompt_tokens(plan))
        scheduler = self.loop.scheduler
        compiling = sum(1 + len(command.sample_ids) for command in self.compiling.values())
        stats = EngineStats(len(scheduler.running), len(scheduler.waiting) + compiling,
                            scheduler.block_manager.num_used_blocks, self.compressions,
                            self.preemptions, self.prefix_queries, self.prefix_hits,
                            self.host_hits, twin_lag_seconds_total=getattr(self.loop, "lag_s", 0.0))  # the twin's
        update = StepUpdate(seq_ids, tokens, finished, self.rejected, stats, logprobs,
                            prompt_logprobs, prefix_hits, queued=self.queued)
        self.rejected, self.changed, self.queued = {}, False, {}
        self._forget_history()
        try:
            self.connection.send(update)
        except OSError:
            raise ServerGone from None

    def _count_prompt_tokens(self, plan) -> dict[str, int]:
        """Add the step's prompt tokens (computed, or found in the prefix cache) to the totals;
        the prompt tokens each request first admitted in this step found in the cache (the
        first chunk of an admission starts where its hits end). A request readmitted after a
        preemption counts in the totals again, as in an offline run's summary, but keeps the
        figure of its first admission."""
        hits = {}
        computed = 0
        for item in plan.prefill:
            computed += item.num_new_tokens
            if item.seq.first_admitted_step == plan.step_id:
                hits[item.seq.seq_id] = item.num_cached_tokens
                self.queued[item.seq.seq_id] = self.step_started - item.seq.arrival_s
        self.prefix_hits += plan.prefix_hit_tokens
        self.host_hits += plan.host_hit_tokens
        self.prefix_queries += plan.prefix_hit_tokens + computed
        return hits

    def _forget_history(self) -> None:
        """A server runs for days: keep no per-step records or finished requests around (the
        offline loop keeps them for its `Run`; the server's /metrics has the aggregates)."""
        self.loop.recorder.forget()


def eos_token_ids(tokenizer) -> frozenset[int]:
    """The tokenizer's end-of-sequence ids (none for models without a tokenizer)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, (list, tuple)) else [eos])


def _send_quietly(connection: Connection, message) -> None:
    try:
        connection.send(message)
    except OSError:  # nobody is listening any more
        pass


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
