"""Tensor parallelism: one engine over N ranks, one process per GPU (gloo processes on the CPU).

Rank 0 is the caller's process. It keeps the one scheduler and the step loop, and holds a
`TensorParallelExecutor` where a single-GPU engine holds its `ModelRunner`, with the same
interface (`execute(plan, tokens) -> [(request, token)]`, `compressor.completed(wait)`), so the
loop, the replay and `LLM` do not know the model is sharded. Each step, rank 0 sends every worker
a compact copy of the plan (per request: id, the token ids it needs, block table, KV length,
position, query slot; the compression jobs; the async batches rank 0 saw complete), then every
rank runs its own `ModelRunner` over its shard of the model and of the KV, query and score caches
(identical block tables: the caches differ only in which heads they hold). The row-parallel
layers all-reduce; the logits are gathered and rank 0 samples. Workers never schedule or sample.

Under async scheduling rank 0 launches a step before the previous one's tokens are on its host, so
the plan it sends cannot carry them: rank 0 broadcasts each launched step's sampled ids on the
device, and each worker feeds its next step's decode rows from them as rank 0's runner feeds its
own (`ModelRunner.forward_fed`; the message names the requests that sampled, in row order).

Compression needs no cross-rank step while each rank holds whole GQA groups: every score is per
KV head (docs/tensor_parallel.md). When KV heads are replicated (more ranks than KV heads), a KV
head's query heads sit on several ranks and the GQA max is all-reduced among them
(`Compressor.reduce_group_max`), so those ranks keep identical tokens and identical scores.

Failures: a worker that raises reports its error and exits; one that dies just exits. Either
way rank 0's pending collective fails (gloo: the peer's connection closes; NCCL: a watcher
thread aborts the process group) and `execute` raises a `TensorParallelError` naming the rank.
Collectives also time out (ZIPAGE_TP_TIMEOUT_S, default 600 s), and a worker whose parent is
gone exits, so nothing hangs.
"""

from __future__ import annotations

import datetime
import gc
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection, wait
from typing import NamedTuple

import torch

from zipage.config import ZipageConfig
from zipage.core.memory import MemoryPlan
from zipage.core.step import CompressionBatch, CompressionJob, Fork, PrefillItem, StepPlan
from zipage.engine.distributed import ShardGroup, set_shard_group, shard_group
from zipage.engine.runner import Launched, ModelRunner
from zipage.engine.sharding import ShardLayout, load_shard
from zipage.errors import ConfigError, ZipageError
from zipage.shape import ModelShape

TIMEOUT_ENV = "ZIPAGE_TP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0
STARTUP_POLL_S = 0.2
FAILURE_GRACE_S = 5.0  # how long rank 0 waits to learn which worker broke its collective
LEAVE_TIMEOUT_S = 10.0  # how long a rank's process-group teardown may take before it aborts


class TensorParallelError(ZipageError):
    """A rank failed; the message names it."""


# ---------------------------------------------------------------------- starting (rank 0)


def start_ranks(model: str, shape: ModelShape, config: ZipageConfig, capacity: MemoryPlan,
                dtype: torch.dtype, devices: list[torch.device], cuda_graphs: bool,
                prefill_graphs: bool) -> "TensorParallelExecutor":
    """Rank 0's executor over one rank per device: a worker process for each further rank, every
    rank loading its shard of `model` (`shape`: the whole model's; `capacity`: per GPU)."""
    setup = dict(world=len(devices), model=model, shape=shape, config=config,
                 capacity=capacity, dtype=dtype, cuda_graphs=cuda_graphs,
                 prefill_graphs=prefill_graphs,
                 timeout_s=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))
    return TensorParallelExecutor.start(setup, devices)


def rank_devices(device: torch.device, world: int) -> list[torch.device]:
    """The device of each rank: `device` and the GPUs after it (on the CPU, `device` for all)."""
    if device.type != "cuda" or world == 1:
        return [device] * world
    first = device.index or 0
    visible = torch.cuda.device_count()
    if first + world > visible:
        raise ConfigError(f"tensor_parallel: {world} ranks need {world} GPUs from cuda:{first}, "
                          f"but {visible} are visible; use --tensor-parallel "
                          f"{max(1, visible - first)} or fewer (or set CUDA_VISIBLE_DEVICES)")
    return [torch.device("cuda", first + rank) for rank in range(world)]


# ---------------------------------------------------------------------- the plan on the wire


@dataclass
class ShardRequest:
    """What a worker rank knows of a request in a step: enough to lay out its batch."""

    seq_id: str
    block_table: list[int]
    query_slot: int | None
    kv_len: int
    position: int


def encode_step(plan: StepPlan, tokens: dict[str, list[int]], completed: list[int]) -> tuple:
    """A plan as plain data for the workers: every kind (a mixed step carries its chunks and its
    decodes; a partial chunk its `samples=False`, so no rank computes logits for it)."""
    prefill = [(item.seq.seq_id, item.num_cached_tokens, item.num_tokens,
                list(item.seq.block_table), item.seq.query_slot,
                tokens[item.seq.seq_id][item.num_cached_tokens:item.num_tokens], item.samples,
                item.prompt_logits)
               for item in plan.prefill]
    decode = [(seq.seq_id, seq.kv_len, seq.position, list(seq.block_table), seq.query_slot,
               tokens[seq.seq_id][-1]) for seq in plan.decode]
    launch = plan.compress_launch
    return (plan.step_id, plan.kind, prefill, decode, encode_jobs(plan.compress_sync),
            None if launch is None else (launch.batch_id, encode_jobs(launch.jobs)), completed,
            plan.block_copies, plan.kv_saves, plan.kv_loads)


def sampled_rows(plan: StepPlan) -> int:
    """Tokens `plan` samples (the rows of rank 0's `Launched.sampled`): each chunk that reaches
    its prompt's end, each decode row, each fork."""
    return sum(1 for item in plan.prefill if item.samples) + len(plan.decode) + len(plan.forks)


class SampledRow(NamedTuple):
    """A request that sampled in the step before, as a worker knows it: its id, in row order."""

    seq_id: str


class ShardJobRequest(NamedTuple):
    """What a worker rank knows of a compression's request: the policy that scores it (its
    own, or None for the deployment's), read where rank 0 reads `Sequence.scoring`."""

    scoring: str | None


def encode_jobs(jobs: list[CompressionJob]) -> list[tuple]:
    return [(job.source_table, job.target_blocks, job.query_slot, job.is_first,
             getattr(job.seq, "scoring", None)) for job in jobs]


def decode_jobs(jobs: list[tuple]) -> list[CompressionJob]:
    return [CompressionJob(seq=ShardJobRequest(scoring), source_table=source,
                           target_blocks=target, new_block=-1, released=[], query_slot=slot,
                           is_first=first)
            for source, target, slot, first, scoring in jobs]


def decode_step(message: tuple) -> tuple[StepPlan, dict[str, list[int]], list[int]]:
    step_id, kind, prefill, decode, sync, launch, completed, copies, saves, loads = message
    plan = StepPlan(step_id=step_id, kind=kind, compress_sync=decode_jobs(sync),
                    forks=[Fork(None, None, copy) for copy in copies],
                    kv_saves=saves, kv_loads=loads)  # each rank copies its own heads' share
    if launch is not None:
        plan.compress_launch = CompressionBatch(launch[0], decode_jobs(launch[1]))
    tokens: dict[str, list[int]] = {}
    for seq_id, start, end, table, slot, ids, samples, prompt_logits in prefill:
        request = ShardRequest(seq_id, table, slot, start, end - 1)
        plan.prefill.append(PrefillItem(request, start, end, samples, prompt_logits))
        tokens[seq_id] = [0] * start + ids  # the runner reads tokens [start, end)
    for seq_id, kv_len, position, table, slot, last in decode:
        plan.decode.append(ShardRequest(seq_id, table, slot, kv_len, position))
        tokens[seq_id] = [last]  # a decode step reads only the last token
    plan.num_decode = len(plan.decode)
    return plan, tokens, completed


# ---------------------------------------------------------------------- one rank


def start_rank(rank: int, device: torch.device, setup: dict, store) -> tuple[ModelRunner, object]:
    """Join the process group, load this rank's shard and build its runner (every rank)."""
    import torch.distributed as dist

    world = setup["world"]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        gc.collect()  # a dropped engine (executor <-> compressor proxy cycle) stops its workers
    if dist.is_initialized():
        raise ConfigError("tensor_parallel: this process already holds a process group: another "
                          "tensor-parallel engine is still open (close it first: engine.close() "
                          "or LLM.close()), or an earlier one could not leave its group (see the "
                          "warning above; start a new process)")
    timeout = datetime.timedelta(seconds=setup["timeout_s"])
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    layout = ShardLayout(setup["shape"], rank, world)
    replica_group = None
    for ranks in layout.replica_groups():  # every rank creates every group, in the same order
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            replica_group = group
    group = ShardGroup(rank, world, dist.group.WORLD)
    with shard_group(group):
        model, tokenizer = load_shard(setup["model"], layout, setup["dtype"], device)
        runner = ModelRunner(model, layout.local_shape(), setup["config"], setup["capacity"],
                             setup["dtype"], device, cuda_graphs=setup["cuda_graphs"],
                             prefill_graphs=setup["prefill_graphs"])
    if replica_group is not None and runner.compressor is not None:
        runner.compressor.reduce_group_max = partial(_all_reduce_max, group=replica_group)
    return runner, tokenizer


def _all_reduce_max(tensor: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    tensor = tensor.contiguous()
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def worker_step(runner: ModelRunner, message: tuple) -> tuple[StepPlan, dict[str, list[int]]]:
    """A step's plan and tokens as a worker runs them, after the async batches rank 0 saw done
    are done on this rank too (their compressed requests decode again in this step)."""
    plan, tokens, completed = decode_step(message)
    if completed and runner.compressor is not None:
        runner.compressor.completed(wait=True)
    return plan, tokens


def run_step(runner: ModelRunner, message: tuple) -> None:
    """A worker's share of one step: the compressions and the forward pass, no sampling."""
    runner.forward(*worker_step(runner, message))


def run_launched(runner: ModelRunner, message: tuple, previous_ids: list[str], rows: int,
                 fed: torch.Tensor | None) -> torch.Tensor | None:
    """A worker's share of a step launched under async scheduling: `run_step` with its decode
    rows fed the ids rank 0 sampled in the step before (`fed`, from `previous_ids`' requests),
    then this step's sampled ids received from rank 0 (returned: the next step's `fed`)."""
    import torch.distributed as dist

    plan, tokens = worker_step(runner, message)
    previous = (Launched([SampledRow(seq_id) for seq_id in previous_ids], fed, None, None)
                if fed is not None and previous_ids else None)
    runner.forward_fed(plan, tokens, previous)
    if not rows:
        return None
    sampled = torch.empty(rows, dtype=torch.int64, device=runner.device)
    dist.broadcast(sampled, src=0)
    return sampled


def cache_snapshot(runner: ModelRunner) -> dict[str, torch.Tensor | None]:
    caches = runner.caches
    return {name: None if tensor is None else tensor.detach().cpu().clone()
            for name, tensor in (("kv", caches.kv), ("query", caches.query),
                                 ("score", caches.score))}


# ---------------------------------------------------------------------- worker process


def worker_main(fd: int) -> None:
    """A worker rank: set up from rank 0's first message, then run what rank 0 sends."""
    connection = Connection(fd)
    rank = None
    try:
        setup = connection.recv()
        rank, device = setup["rank"], torch.device(setup["device"])
        _exit_with_parent()
        if device.type == "cpu":
            torch.set_num_threads(1)
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", setup["port"], setup["world"], is_master=False,
                              timeout=datetime.timedelta(seconds=setup["timeout_s"]))
        connection.send(("hello", rank))
        runner, _ = start_rank(rank, device, setup, store)
        set_shard_group(ShardGroup(rank, setup["world"], dist.group.WORLD))
        connection.send(("ready", rank))
        fed = None  # the ids rank 0 sampled in the step launched last (async scheduling)
        while True:
            try:
                kind, *payload = connection.recv()
            except EOFError:
                break  # rank 0 is gone
            if kind == "step":
                run_step(runner, payload[0])
                fed = None  # a synchronous step's tokens reach the next plan on the host
            elif kind == "launch":
                fed = run_launched(runner, *payload, fed)
            elif kind == "compress":
                runner.compressor.run(decode_jobs(payload[0]))
            elif kind == "warm_logits":
                runner.warm_logits()
            elif kind == "caches":
                # Plain pickle copies the tensors (the connection's pickler would try to
                # share their memory between processes).
                connection.send_bytes(pickle.dumps(("caches", rank, cache_snapshot(runner))))
            elif kind == "stop":
                # Rank 0 tears its group down at the same moment: NCCL's teardown waits for
                # the peers, so a worker that just exited would leave rank 0 hanging.
                _drop_graphs(runner)
                _leave_group(dist)
                break
    except BaseException as error:  # report, then leave at once: peers see the closed links
        try:
            connection.send(("error", rank, f"{type(error).__name__}: {error}"))
        except OSError:
            pass
        os._exit(1)
    os._exit(0)


def _drop_graphs(runner: ModelRunner | None) -> None:
    """Free a runner's CUDA graphs. Graphs that captured NCCL collectives hold on to the
    communicator: destroying (or even aborting) the process group while they exist hangs."""
    if runner is None or not (runner.graphs or runner.prefill_graphs):
        return
    runner.graphs = {}
    runner.balanced_graphs = {}  # the decode graphs of the balanced split, too
    runner.prefill_graphs = {}  # prefill graphs capture the all-reduces too
    gc.collect()
    torch.cuda.synchronize(runner.device)


def _leave_group(dist, timeout_s: float = LEAVE_TIMEOUT_S) -> None:
    """Destroy this process's process group; abort it if that takes longer than `timeout_s` (a
    peer that died cannot take part in NCCL's teardown). Both run on daemon threads with a bound,
    so leaving never hangs the caller: if even the abort does not return, the group is left
    behind with a warning (this process cannot start another tensor-parallel engine, and says
    so)."""
    if not (dist.is_available() and dist.is_initialized()):
        return

    def bounded(action, name: str) -> bool:
        done = threading.Event()

        def run() -> None:
            try:
                action()
            except Exception:  # noqa: BLE001 - a broken group cannot always be torn down cleanly
                pass
            done.set()

        threading.Thread(target=run, daemon=True, name=name).start()
        return done.wait(timeout_s)

    started = time.monotonic()
    if bounded(dist.destroy_process_group, "zipage-tp-leave"):
        return
    if bounded(dist.distributed_c10d._abort_process_group, "zipage-tp-abort"):
        print(f"zipage: tensor parallel: the process group did not shut down within "
              f"{timeout_s:g} s; aborted it", file=sys.stderr, flush=True)
        return
    print(f"zipage: tensor parallel: leaving the process group did not finish in "
          f"{time.monotonic() - started:.0f} s (destroy, then abort); left it behind",
          file=sys.stderr, flush=True)


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


# ---------------------------------------------------------------------- rank 0


@dataclass
class _Worker:
    rank: int
    process: subprocess.Popen
    connection: Connection


@dataclass
class _Links:
    """Rank 0's side of the workers, shared with the watcher thread (not the executor, so the
    executor can be garbage-collected and its finalizer stop the workers)."""

    workers: list[_Worker]
    backend: str
    replies: queue.Queue = field(default_factory=queue.Queue)
    failure: str | None = None
    closing: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    runner: "weakref.ref | None" = None  # rank 0's runner, whose CUDA graphs go before the group

    def fail(self, message: str) -> None:
        with self.lock:
            if self.failure is None and not self.closing:
                self.failure = message
            else:
                return
        if self.backend == "nccl":
            try:  # unblock rank 0's pending NCCL collective
                import torch.distributed as dist

                dist.distributed_c10d._abort_process_group()
            except Exception:  # noqa: BLE001 - best effort; the collective timeout remains
                pass

    def watch(self) -> None:
        open_connections = {worker.connection: worker for worker in self.workers}
        while open_connections and not self.closing:
            for connection in wait(list(open_connections), timeout=STARTUP_POLL_S):
                worker = open_connections[connection]
                try:
                    message = connection.recv()
                except (EOFError, OSError):
                    del open_connections[connection]
                    if not self.closing:
                        code = worker.process.wait()
                        self.fail(f"rank {worker.rank} exited with code {code}")
                    continue
                except Exception as error:  # noqa: BLE001 - an unreadable reply must not hang rank 0
                    del open_connections[connection]
                    self.fail(f"rank {worker.rank} sent an unreadable message ({error})")
                    continue
                if message[0] == "error":
                    self.fail(f"rank {message[1]} failed: {message[2]}")
                else:
                    self.replies.put(message)


class TensorParallelExecutor:
    """Rank 0's stand-in for a `ModelRunner`: runs each step on every rank, samples on rank 0."""

    def __init__(self, runner: ModelRunner, tokenizer, links: _Links, group: ShardGroup) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.links = links
        self.group = group
        self.world = group.world
        self.device = runner.device
        self.shape = runner.shape  # this rank's shard
        self.config = runner.config
        self.caches = runner.caches
        self.completed_batches: list[int] = []
        self.compressor = _CompressorProxy(self) if runner.compressor is not None else None
        self.closed = False
        self._finalizer = weakref.finalize(self, _stop, links)

    @classmethod
    def start(cls, setup: dict, devices: list[torch.device]) -> "TensorParallelExecutor":
        import torch.distributed as dist

        world = setup["world"]
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=setup["timeout_s"]))
        links = _Links([], "nccl" if devices[0].type == "cuda" else "gloo")
        try:
            for rank in range(1, world):
                links.workers.append(_spawn(rank))
            for worker in links.workers:
                worker.connection.send({**setup, "rank": worker.rank, "port": store.port,
                                        "device": str(devices[worker.rank])})
            threading.Thread(target=links.watch, daemon=True, name="zipage-tp-watch").start()
            _await(links, "hello", world - 1)
            runner, tokenizer = start_rank(0, devices[0], setup, store)
            _await(links, "ready", world - 1)
        except BaseException:
            _stop(links)
            if links.failure is not None:
                raise TensorParallelError(f"tensor parallel: {links.failure}") from None
            raise
        links.runner = weakref.ref(runner)
        return cls(runner, tokenizer, links, ShardGroup(0, world, dist.group.WORLD))

    # ------------------------------------------------------------------ the runner interface

    def execute(self, plan: StepPlan, tokens: dict[str, list[int]], structured=None) -> list:
        self._send(("step", self._encoded(plan, tokens)))
        with self._guard(), shard_group(self.group):
            return self.runner.execute(plan, tokens, structured)  # rank 0 samples

    needs_sync = staticmethod(ModelRunner.needs_sync)

    def warm_logits(self) -> None:
        """`ModelRunner.warm_logits` on every rank: the LM head and its logits gather at every
        row count, in the same order everywhere."""
        self._send(("warm_logits",))
        with self._guard(), shard_group(self.group):
            self.runner.warm_logits()

    def launch(self, plan: StepPlan, tokens: dict[str, list[int]],
               previous: Launched | None = None) -> Launched:
        """`ModelRunner.launch` on every rank: rank 0 samples, then broadcasts the sampled ids
        on the device for the workers' next step."""
        import torch.distributed as dist

        rows = sampled_rows(plan)
        previous_ids = [] if previous is None else [seq.seq_id for seq in previous.sequences]
        self._send(("launch", self._encoded(plan, tokens), previous_ids, rows))
        with self._guard(), shard_group(self.group):
            launched = self.runner.launch(plan, tokens, previous)
            sampled = launched.sampled
            if (0 if sampled is None else len(sampled)) != rows:
                raise TensorParallelError(f"tensor parallel: step {plan.step_id} sampled "
                                          f"{0 if sampled is None else len(sampled)} tokens, "
                                          f"the workers expect {rows}")
            if rows:
                dist.broadcast(sampled, src=0)
        return launched

    @property
    def last_logits(self) -> torch.Tensor | None:
        return self.runner.last_logits

    @property
    def last_logprobs(self) -> dict[str, tuple]:
        return self.runner.last_logprobs

    @property
    def last_prompt_logprobs(self) -> dict[str, list]:
        return self.runner.last_prompt_logprobs

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.runner.kv_cache

    @property
    def graphed_steps(self) -> dict[str, bool]:
        return self.runner.graphed_steps

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        return self.runner.prefill_buckets

    @property
    def decode_graph_sizes(self) -> list[int]:
        return self.runner.decode_graph_sizes

    def gather_caches(self) -> list[dict[str, torch.Tensor | None]]:
        """Every rank's caches on the CPU, by rank (tests compare them with a one-rank run)."""
        self._send(("caches",))
        snapshots = {0: cache_snapshot(self.runner)}
        while len(snapshots) < self.world:
            _, rank, snapshot = self._reply("caches")
            snapshots[rank] = snapshot
        return [snapshots[rank] for rank in range(self.world)]

    def shutdown(self) -> None:
        """Stop the workers and leave the process group (also run when the executor is freed)."""
        if not self.closed:
            self.closed = True
            self._finalizer()

    # ------------------------------------------------------------------ helpers

    def _encoded(self, plan: StepPlan, tokens: dict[str, list[int]]) -> tuple:
        """`plan` for the workers, with the async batches rank 0 saw done since the last one."""
        completed, self.completed_batches = self.completed_batches, []
        return encode_step(plan, tokens, completed)

    def _send(self, message: tuple) -> None:
        self._check()
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._guard():
            for worker in self.links.workers:
                worker.connection.send_bytes(data)

    def _reply(self, kind: str) -> tuple:
        with self._guard():
            return _await(self.links, kind, 1)[0]

    def _check(self) -> None:
        if self.closed:
            raise TensorParallelError("tensor parallel: this engine was shut down"
                                      + (f" after {self.links.failure}" if self.links.failure
                                         else "") + "; build a new one")

    def _guard(self):
        return _Guard(self)


class _Guard:
    """Turns an error on rank 0 into a shut-down executor and, when a worker caused it, a
    `TensorParallelError` naming that worker."""

    def __init__(self, executor: TensorParallelExecutor) -> None:
        self.executor = executor

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        if error is None:
            return False
        links = self.executor.links
        deadline = time.monotonic() + FAILURE_GRACE_S
        while links.failure is None and time.monotonic() < deadline and isinstance(
                error, (RuntimeError, OSError, TensorParallelError)):
            time.sleep(0.05)  # the watcher learns which worker broke the collective
        self.executor.shutdown()
        if links.failure is not None and not isinstance(error, TensorParallelError):
            raise TensorParallelError(f"tensor parallel: {links.failure}") from None
        return False


class _CompressorProxy:
    """The loop's view of compression on all ranks: rank 0's compressor, plus the bookkeeping
    that tells the workers which async batches completed."""

    def __init__(self, executor: TensorParallelExecutor) -> None:
        self.executor = executor
        self.local = executor.runner.compressor

    def completed(self, wait: bool = False) -> list[int]:
        done = self.local.completed(wait)
        self.executor.completed_batches += done
        return done

    def run(self, jobs: list[CompressionJob]) -> None:
        """Compress `jobs` on every rank now (calibration times this)."""
        self.executor._send(("compress", encode_jobs(jobs)))
        with self.executor._guard(), shard_group(self.executor.group):
            self.local.run(jobs)


def worker_command(rank: int) -> list[str]:
    """The command line of worker `rank`, less the descriptor of its link to rank 0."""
    return [sys.executable, "-m", "zipage.engine.parallel"]


def _spawn(rank: int) -> _Worker:
    ours, theirs = socket.socketpair()
    process = subprocess.Popen([*worker_command(rank), str(theirs.fileno())],
                               pass_fds=(theirs.fileno(),))
    theirs.close()
    return _Worker(rank, process, Connection(ours.detach()))


def _await(links: _Links, kind: str, count: int) -> list[tuple]:
    """`count` replies of `kind` from the workers; raises if a worker fails meanwhile."""
    replies = []
    while len(replies) < count:
        if links.failure is not None:
            raise TensorParallelError(f"tensor parallel: {links.failure}")
        try:
            message = links.replies.get(timeout=STARTUP_POLL_S)
        except queue.Empty:
            continue
        if message[0] == kind:
            replies.append(message)
    return replies


def _stop(links: _Links) -> None:
    """Ask the workers to stop, kill those that do not within seconds, leave the group."""
    import torch.distributed as dist

    links.closing = True
    for worker in links.workers:
        try:
            worker.connection.send(("stop",))
        except OSError:
            pass
    _drop_graphs(links.runner() if links.runner is not None else None)
    _leave_group(dist)  # together with the workers, which leave on "stop"
    deadline = time.monotonic() + 5.0
    for worker in links.workers:
        try:
            worker.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            worker.process.kill()
            worker.process.wait()
        worker.connection.close()


if __name__ == "__main__":
    worker_main(int(sys.argv[1]))
