"""`zipage serve --data-parallel N`: N engine processes behind one HTTP front.

Each replica is a whole engine (its own model copy, scheduler and KV cache) in a process of its
own (`engine_client` / `engine_process`, the single-engine path unchanged), on its own GPUs
(`Setup.visible_devices`) or its own CPU cores (`Setup.cpus`). The HTTP process routes each
request to one replica by a policy of `zipage.core.routing`, the very code the simulator's
cluster model (`sim/cluster.py`, `zipage plan --replicas N --routing P`) routes by: the router
hands it the request's chained prompt-block hashes (what each replica's prefix cache keys on) and
each replica's load (`EngineClient.load`: its requests in flight and the KV blocks its latest step
reported) and the request's session (the body's optional `session_id`, which the app hands
`submit`; session-affinity keeps a session's turns on one replica).

A replica whose engine process dies fails only its own requests in flight (503, as one engine
does) and is restarted by its `EngineClient`; while it is down the router skips it, so the others
keep serving, and once it is back the router has forgotten the prefixes and sessions routed to it
(its new prefix cache is empty). /health is 200 while any replica serves ("degraded" when some are down) and lists
each one. One replica past `--max-engine-restarts` stops the server (exit 1), as one engine does:
a supervisor restarts it whole.

`ReplicaSet` offers the app what an `EngineClient` does (submit, abort, admission, the waiting
count), so the app serves one engine or many alike.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from zipage.core.block_manager import prompt_block_hashes
from zipage.core.routing import DOWN, choose_up, make_policy
from zipage.errors import ConfigError
from zipage.serve.engine_client import EngineClient, EngineStopped, RequestHandle
from zipage.serve.wire import Setup


class ReplicaSet:
    def __init__(self, clients: list[EngineClient], routing: str) -> None:
        self.clients = clients
        self.routing = routing
        self.policy = make_policy(routing, len(clients))
        first = clients[0]
        self.info = first.info  # the replicas are built alike: one answers for all
        self.admission = first.admission
        self.block_size = first.info.config.block_size
        self._on_fatal = None
        self.metrics = None  # the server's, once attached
        for client in clients:
            # A restarted replica's prefix cache is empty: prefix (and session) affinity must
            # not keep sending it the prefixes (and sessions) its dead predecessor held.
            client.on_restarted = functools.partial(self.policy.forget, client.index)
            if len(clients) > 1:
                client.label = f"replica {client.index}: "

    @classmethod
    def start(cls, setups: list[Setup], max_restarts: int, routing: str) -> "ReplicaSet":
        """Start one engine process per setup, all at once (each loads its own model copy);
        if any fails, stop the others and raise its error."""
        with ThreadPoolExecutor(len(setups)) as pool:
            futures = [pool.submit(EngineClient.start, setup, max_restarts, index)
                       for index, setup in enumerate(setups)]
        clients, failure = [], None
        for future in futures:
            try:
                clients.append(future.result())
            except BaseException as error:  # noqa: BLE001 - the first is raised below
                failure = failure or error
        if failure is not None:
            for client in clients:
                client.stop_process()
            raise failure
        return cls(clients, routing)

    # ---------------------------------------------------------------- what the app calls

    @property
    def replicas(self) -> int:
        return len(self.clients)

    @property
    def alive(self) -> bool:
        return any(client.alive for client in self.clients)

    @property
    def error(self) -> str | None:
        """Why no replica serves (None while one does)."""
        if self.alive:
            return None
        return next((client.error for client in self.clients if client.error), None)

    @property
    def fatal(self) -> str | None:
        return next((client.fatal for client in self.clients if client.fatal), None)

    @property
    def on_fatal(self):
        return self._on_fatal

    @on_fatal.setter
    def on_fatal(self, callback) -> None:
        self._on_fatal = callback
        for client in self.clients:
            client.on_fatal = callback

    @property
    def num_waiting(self) -> int:
        return sum(client.num_waiting for client in self.clients)

    @property
    def pids(self) -> list[int]:
        return [client.pid for client in self.clients]

    def attach(self, metrics) -> None:
        self.metrics = metrics
        for client in self.clients:
            client.attach(metrics.replica(client.index))

    def choose(self, prompt_token_ids: list[int],
               session: str | None = None) -> tuple[int, list[int]]:
        """The replica that takes a request of these tokens (of `session`, the request body's
        `session_id`; None without one), and the block keys routed."""
        keys = prompt_block_hashes(prompt_token_ids, self.block_size)
        loads = [client.load() if client.alive else DOWN for client in self.clients]
        if all(load is DOWN for load in loads):
            raise EngineStopped(self.error or "no engine process is running")
        return choose_up(self.policy, keys, loads, session), keys

    def submit(self, prompt_token_ids: list[int], sampling,
               session: str | None = None) -> list[RequestHandle]:
        index, keys = self.choose(prompt_token_ids, session)
        handles = self.clients[index].submit(prompt_token_ids, sampling)
        # Only once it went: a refused send taught nothing.
        self.policy.routed(index, keys, session)
        if self.metrics is not None:
            self.metrics.replica(index).routed.inc()
        return handles

    def abort(self, handle: RequestHandle, finish_reason: str | None = None) -> None:
        self.clients[handle.replica].abort(handle, finish_reason)

    def health(self) -> list[dict]:
        return [{"replica": client.index, "pid": client.pid,
                 "status": "ok" if client.alive else "error",
                 **({} if client.alive else {"error": client.error or "stopped"})}
                for client in self.clients]

    def close(self, reason: str = "the server is shutting down") -> None:
        for client in self.clients:
            client.close(reason)

    def stop_process(self) -> None:
        """Stop every engine process (each told to stop, then waited for, in parallel)."""
        with ThreadPoolExecutor(len(self.clients)) as pool:
            list(pool.map(EngineClient.stop_process, self.clients))


def replica_setups(setup: Setup, replicas: int, tensor_parallel: int = 1) -> list[Setup]:
    """One `Setup` per replica: on a GPU, replica i sees GPUs i*tp .. i*tp+tp-1 of those visible
    here (as cuda:0..); on the CPU, replica i runs on its own slice of the usable cores, when
    there are at least as many cores as replicas (else they share them)."""
    if setup.device == "cpu":
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if replicas == 1 or len(cores) < replicas:
            return [setup] * replicas
        share = len(cores) // replicas
        return [replace(setup, cpus=tuple(cores[index * share:(index + 1) * share]))
                for index in range(replicas)]
    if replicas == 1:  # one engine sees what this process sees, as without the flag
        return [setup]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = ([item.strip() for item in visible.split(",") if item.strip()]
               if visible is not None else [str(index) for index in range(_gpu_count())])
    needed = replicas * tensor_parallel
    if len(devices) < needed:
        raise ConfigError(f"--data-parallel: {replicas} replicas of {tensor_parallel} GPU"
                          f"{'s' * (tensor_parallel != 1)} need {needed} GPUs, {len(devices)} "
                          "are visible; use fewer replicas (or set CUDA_VISIBLE_DEVICES)")
    return [replace(setup, visible_devices=",".join(
        devices[index * tensor_parallel:(index + 1) * tensor_parallel]))
        for index in range(replicas)]


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()
