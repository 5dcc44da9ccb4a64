"""`zipage serve --ray ADDRESS --data-parallel N`: the replicas as Ray Serve deployments.

Two Serve applications on the Ray cluster:

- `zipage-engine`: the `ZipageEngine` deployment, N replicas, each asking Ray for its GPUs
  (`--tensor-parallel` of them) or one CPU, so Ray places them. A replica runs one engine process
  (`EngineClient`, the single-engine path unchanged; under `--simulate` that process steps the
  live twin, sim/live.py, and the replica asks for `TWIN_NUM_CPUS` of a CPU, no GPU, no torch)
  and streams each request's deltas back. It reports its engine's latest step report
  (`record_routing_stats`: requests running and waiting, KV blocks in use) and fails Ray's
  health check once its engine process is gone, so Ray replaces the replica; its requests in
  flight fail alone, with the same 503 as one engine's.
- `zipage`: the `ZipageIngress` deployment, the OpenAI app of `zipage/serve/app.py` itself as the
  HTTP ingress (Ray's proxy listens on --host/--port). Its engine is `RayEngines`, which offers
  the app what a `ReplicaSet` does and sends each request through a handle to `ZipageEngine`.
  Its tokenizer is the one the HTTP process would load (`TokenizerSource`: the model's, or the
  twin's).

Routing: `ZipageRouter`, a Ray Serve request router, applies the `--routing` policy of
`zipage.core.routing` (the code `zipage plan --routing` simulates and `--data-parallel` on one host
routes by) to the request's prompt-block hashes, its session (the body's `session_id`, which the
app hands `RayEngines.submit` and which travels as `generate`'s `session` argument) and each
replica's load: the requests this router has in flight there (exact: it sees each one routed and
completed) and the KV blocks the replica last reported. Ray runs the router in the process that
holds the handle, the ingress, so the router also hands each report to the ingress's `RayEngines`,
which sets the replica's /metrics gauges from it, as each engine's step report sets them under
`--data-parallel`.
"""

from __future__ import annotations

import asyncio
import time

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import FIFOMixin, RequestRouter

from zipage.core.admission import Admission
from zipage.core.block_manager import prompt_block_hashes
from zipage.core.routing import DOWN, ReplicaLoad, choose_up, make_policy
from zipage.serve import TWIN_NUM_CPUS
from zipage.serve.engine_client import Delta, EngineClient, EngineStopped, RequestHandle
from zipage.serve.tokenizer import TokenizerSource
from zipage.serve.wire import EngineStats, Ready, Setup

ENGINE_APP, INGRESS_APP = "zipage-engine", "zipage"
ENGINE, INGRESS = "ZipageEngine", "ZipageIngress"
HEALTH_CHECK_PERIOD_S = 2.0  # how soon Ray notices a replica whose engine process died
REPORT_PERIOD_S = 1.0  # how often Ray asks each replica for its report (routing, gauges)

# The ingress's engines, in the ingress's process (None elsewhere, e.g. where `deploy` runs):
# where the router there hands the replicas' reports.
_ingress_engines: "RayEngines | None" = None


# ---------------------------------------------------------------- the engine replicas


class ZipageEngine:
    def __init__(self, setup: Setup) -> None:
        # No restarts here: Ray replaces the whole replica (a new actor, a new engine process).
        self.client = EngineClient.start(setup, max_restarts=0)
        self.rank = serve.get_replica_context().rank.rank
        self._attached = False

    def describe(self) -> Ready:
        return self.client.info

    async def generate(self, prompt_token_ids: list[int], sampling, session: str | None = None):
        """Stream (rank, sample index, Delta, prompt log-probabilities or None) items; a client
        that leaves cancels this generator, which aborts the request in the engine. (`session`
        is for the router, which reads it from the request's arguments.)"""
        if not self._attached:
            self.client.attach(None)
            self._attached = True
        handles = self.client.submit(prompt_token_ids, sampling)  # EngineStopped: none ran
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, handle: RequestHandle) -> None:
            while True:
                delta = await handle.deltas.get()
                merged.put_nowait((index, delta))
                if delta.finish_reason is not None or delta.error is not None:
                    return

        tasks = [asyncio.ensure_future(pump(index, handle)) for index, handle in
                 enumerate(handles)]
        sent_prompt = [False] * len(handles)
        try:
            left = len(handles)
            while left:
                index, delta = await merged.get()
                prompt = None
                if not sent_prompt[index] and handles[index].prompt_logprobs:
                    prompt, sent_prompt[index] = list(handles[index].prompt_logprobs), True
                yield self.rank, index, delta, prompt
                if delta.finish_reason is not None or delta.error is not None:
                    left -= 1
        finally:
            for task in tasks:
                task.cancel()
            for handle in handles:
                self.client.abort(handle)

    def record_routing_stats(self) -> dict:
        """This replica's report, which Ray pulls every REPORT_PERIOD_S for the router."""
        return {"rank": self.rank, "alive": self.client.alive, "stats": self.client.stats}

    def check_health(self) -> None:
        if not self.client.alive:
            raise RuntimeError(self.client.error or "the engine process stopped")

    def __del__(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.stop_process()


class ZipageRouter(FIFOMixin, RequestRouter):
    """The `--routing` policy over the engine replicas (see the module docstring)."""

    def initialize_state(self, routing: str = "least-loaded", replicas: int = 1,
                         block_size: int = 16, **kwargs) -> None:
        self.policy = make_policy(routing, replicas)
        self.block_size = block_size
        self.slots: list = [None] * replicas  # replica id in each of the policy's indices
        # request -> the replica it went to, from the moment it is chosen (a request chosen
        # while the one before it is still being sent must see that one's load) to completion.
        self.placed: dict[str, object] = {}

    def _slot(self, replica_id) -> int | None:
        if replica_id in self.slots:
            return self.slots.index(replica_id)
        return None

    def _assign(self, candidates) -> None:
        """Give each new replica a free index (a replaced replica's, its prefix and session
        memory cleared: its cache starts empty)."""
        live = {replica.replica_id for replica in candidates}
        for replica in candidates:
            if self._slot(replica.replica_id) is None:
                free = next((index for index, held in enumerate(self.slots)
                             if held is None or held not in live), None)
                if free is None:
                    continue
                self.slots[free] = replica.replica_id
                self.policy.forget(free)

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if not candidate_replicas:
            return []
        self._assign(candidate_replicas)
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        loads = []
        for held in self.slots:
            replica = by_id.get(held)
            stats = replica.routing_stats if replica is not None else {}
            if replica is None or stats.get("alive") is False:
                loads.append(DOWN)
            else:
                reported: EngineStats | None = stats.get("stats")
                loads.append(ReplicaLoad(sum(placed == held for placed in self.placed.values()),
                                         reported.blocks_used if reported is not None else 0))
        if all(load is DOWN for load in loads):
            return [candidate_replicas]
        keys, session = [], None
        if pending_request is not None:
            if pending_request.args:
                keys = prompt_block_hashes(pending_request.args[0], self.block_size)
            session = (pending_request.kwargs or {}).get("session")
        index = choose_up(self.policy, keys, loads, session)
        self.policy.routed(index, keys, session)
        chosen = by_id[self.slots[index]]
        if pending_request is not None:
            self.placed[pending_request.metadata.internal_request_id] = chosen.replica_id
        return [[chosen], [replica for replica in candidate_replicas if replica is not chosen]]

    def update_replicas(self, replicas) -> None:
        """Ray's news of the running replicas and their latest reports (each time one changes)."""
        super().update_replicas(replicas)
        # Ray pickles this class by value, with copies of the globals it names: the ingress's
        # engines are looked up in the module itself, where the ingress put them.
        from zipage.serve import ray_serve

        if ray_serve._ingress_engines is not None:
            ray_serve._ingress_engines.report({replica.replica_id: replica.routing_stats
                                               for replica in replicas})

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        # Ray may have sent it to a later rank (the first was full).
        self.placed[pending_request.metadata.internal_request_id] = replica_id

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self.placed.pop(internal_request_id, None)


# ---------------------------------------------------------------- the ingress


class RayEngines:
    """What the app reads of its engine (`ReplicaSet`'s interface), over a handle to the
    `ZipageEngine` deployment."""

    def __init__(self, handle, info: Ready, replicas: int) -> None:
        self.handle = handle.options(stream=True)
        self.info = info
        self.replicas = replicas
        self.admission = Admission(info.config, info.capacity.num_blocks)
        self.alive = True  # Ray keeps the replicas up; a request learns of a dead one
        self.error = None
        self.fatal = None
        self.on_fatal = None
        self.metrics = None
        self._requests: dict[int, tuple[list[RequestHandle], asyncio.Task]] = {}
        self._request_of: dict[str, int] = {}  # a sample's seq_id -> its request
        self._ids = 0
        self._serving: list = [None] * replicas  # the Ray replica id last reporting as each rank

    @property
    def num_waiting(self) -> int:
        return sum(handle.waiting for handles, _ in self._requests.values()
                   for handle in handles)

    def attach(self, metrics) -> None:
        self.metrics = metrics

    def report(self, reports: dict) -> None:
        """The running replicas' latest reports (Ray replica id -> `record_routing_stats`), from
        the router (on its event loop): each rank's gauges are its engine's latest step report.
        A rank that lost its replica, or whose engine died, is down; a new replica there is a
        restart, as a new engine process is under `--data-parallel`."""
        if self.metrics is None:
            return
        by_rank = {stats["rank"]: (replica_id, stats) for replica_id, stats in reports.items()
                   if stats.get("rank") is not None}  # a new replica has not reported yet
        for rank in range(self.replicas):
            metrics, previous = self.metrics.replica(rank), self._serving[rank]
            replica_id, stats = by_rank.get(rank, (None, {}))
            if replica_id is None or not stats.get("alive"):
                if previous is not None:
                    metrics.engine_down()
                continue
            if replica_id != previous:
                if previous is not None:
                    metrics.engine_restarted()
                self._serving[rank] = replica_id
            metrics.engine_stats(stats["stats"], 0)  # tokens are counted as they arrive here

    def submit(self, prompt_token_ids: list[int], sampling,
               session: str | None = None) -> list[RequestHandle]:
        now = time.perf_counter()
        self._ids += 1
        rid = self._ids
        handles = [RequestHandle(f"ray-{rid}#{index}", len(prompt_token_ids), now)
                   for index in range(sampling.n)]
        task = asyncio.get_running_loop().create_task(
            self._stream(rid, handles, prompt_token_ids, sampling, session))
        self._requests[rid] = (handles, task)
        for handle in handles:
            self._request_of[handle.seq_id] = rid
        return handles

    async def _stream(self, rid, handles, prompt_token_ids, sampling, session) -> None:
        routed = False  # counted once per request, on its first item: its n samples share a replica
        try:
            for attempt in range(2):  # a replica down before the request started: one retry
                try:
                    response = self.handle.generate.remote(prompt_token_ids, sampling,
                                                           session=session)
                    async for rank, index, delta, prompt in response:
                        if not routed and self.metrics is not None:
                            self.metrics.replica(rank).routed.inc()
                        routed = True
                        self._deliver(handles[index], rank, delta, prompt)
                    return
                except EngineStopped as error:
                    if attempt or any(handle.num_tokens for handle in handles):
                        raise
                    message = str(error)
            raise EngineStopped(message)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - the replica or its actor died
            reason = _cause(error)
            for handle in handles:
                if not handle.done:
                    handle.done, handle.waiting = True, False
                    handle.deltas.put_nowait(Delta([], None, f"the engine replica serving "
                                                            f"this request stopped: {reason}; "
                                                            "retry the request", 503))
        finally:
            self._requests.pop(rid, None)
            for handle in handles:
                self._request_of.pop(handle.seq_id, None)

    def _deliver(self, handle: RequestHandle, rank: int, delta: Delta, prompt) -> None:
        metrics = self.metrics.replica(rank) if self.metrics is not None else None
        now = time.perf_counter()
        handle.replica = rank
        if prompt is not None:
            handle.prompt_logprobs[:] = prompt
        if delta.token_ids:
            handle.num_tokens += len(delta.token_ids)
            if metrics is not None:
                metrics.generation_tokens.inc(len(delta.token_ids))
            if handle.first_token_s is None:
                handle.first_token_s, handle.waiting = now, False
                handle.queued_s = delta.queued_s
                if metrics is not None:
                    metrics.first_token(handle)
            elif metrics is not None:  # as `EngineClient` observes it: one per later delta
                metrics.itl.observe(now - handle.last_token_s)
            handle.last_token_s = now
        if delta.finish_reason is not None or delta.error is not None:
            handle.done, handle.waiting = True, False
            if metrics is not None and delta.finish_reason is not None:
                metrics.finished_request(handle, delta.finish_reason, now)
        handle.deltas.put_nowait(delta)

    def abort(self, handle: RequestHandle, finish_reason: str | None = None) -> None:
        if handle.done:
            return
        handle.done, handle.waiting = True, False
        handles, task = self._requests.get(self._request_of.get(handle.seq_id), ([], None))
        if task is not None and all(other.done for other in handles):
            task.cancel()  # cancels the stream: the replica aborts the request in its engine

    def health(self) -> list[dict]:
        try:
            status = serve.status().applications[ENGINE_APP].deployments[ENGINE]
            states = {str(getattr(state, "value", state)): count
                      for state, count in status.replica_states.items()}
        except (KeyError, AttributeError):
            states = {}
        # "error" while Ray replaces a replica: the app then answers "degraded" (still 200).
        running = states.get("RUNNING", 0) >= self.replicas
        return [{"replica": "ray", "status": "ok" if running else "error",
                 "replica_states": states}]

    def close(self, reason: str = "") -> None:
        for _, task in list(self._requests.values()):
            task.cancel()

    def stop_process(self) -> None:
        pass


def _cause(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__


class ZipageIngress:
    def __init__(self, info: Ready, replicas: int, tokenizer: TokenizerSource, name: str,
                 options: dict) -> None:
        global _ingress_engines
        handle = serve.get_deployment_handle(ENGINE, app_name=ENGINE_APP)
        self.engines = _ingress_engines = RayEngines(handle, info, replicas)
        self.tokenizer = tokenizer.load()
        self.name, self.options = name, options

    def __serve_build_asgi_app__(self):
        from zipage.serve.app import build_app

        return build_app(self.engines, self.tokenizer, self.name, **self.options)


# ---------------------------------------------------------------- deploying


def deploy(setup: Setup, replicas: int, routing: str, name: str, options: dict,
           host: str, port: int, tokenizer: TokenizerSource | None = None) -> Ready:
    """Start both applications on the connected Ray cluster; the engine's description.
    `tokenizer`: the ingress's (default: the model's own)."""
    serve.start(http_options={"host": host, "port": port})
    resources = replica_resources(setup)
    router = RequestRouterConfig(
        request_router_class=ZipageRouter,
        request_router_kwargs={"routing": routing, "replicas": replicas,
                               "block_size": setup.settings.config.block_size},
        request_routing_stats_period_s=REPORT_PERIOD_S)
    engine = serve.deployment(
        ZipageEngine, name=ENGINE, num_replicas=replicas, ray_actor_options=resources,
        health_check_period_s=HEALTH_CHECK_PERIOD_S, request_router_config=router,
        # A replica whose engine died has nothing left to drain: replace it without Ray's
        # default 20 s wait for its requests.
        graceful_shutdown_timeout_s=5.0, graceful_shutdown_wait_loop_s=1.0,
        max_ongoing_requests=100_000)
    handle = serve.run(engine.bind(setup), name=ENGINE_APP, route_prefix=None)
    info = handle.describe.remote().result()
    ingress = serve.deployment(serve.ingress()(ZipageIngress), name=INGRESS,
                               ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000)
    tokenizer = tokenizer or TokenizerSource(setup.settings.model)
    serve.run(ingress.bind(info, replicas, tokenizer, name, options),
              name=INGRESS_APP, route_prefix="/")
    return info


def replica_resources(setup: Setup) -> dict:
    """What one engine replica asks Ray for: its GPUs and a CPU; a twin (--simulate), a share
    of a CPU (it sleeps through most of each simulated step)."""
    if setup.simulate is not None:
        return {"num_cpus": TWIN_NUM_CPUS}
    if setup.device == "cuda":
        return {"num_gpus": setup.settings.tensor_parallel, "num_cpus": 1}
    return {"num_cpus": 1}
