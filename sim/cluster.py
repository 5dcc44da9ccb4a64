"""Several simulated engines behind one router: the multi-replica deployment of `zipage plan`.

`simulate_cluster` builds `replicas` independent engines (each its own scheduler, blocks and query
slots, sized exactly as `zipage replay` sizes one) on one shared SimPy clock, and a router process
that hands each trace request, at its arrival time, to one engine by a policy of
`zipage.core.routing` (the same code `zipage serve --data-parallel N --routing P` routes by):
round-robin, the engine with the fewest requests queued or running (`Simulator.load`, ties to the
fewest KV blocks in use, then the lowest index), or prefix affinity (the engine whose earlier
requests share the request's leading prompt blocks, within a load bound). The merged
summary is `summarize` over the union of every engine's step and request records, so throughput,
makespan and the TTFT/TPOT percentiles are the deployment's. Two keys are redefined because the
engines' step records interleave in time: `peak_running` is the peak over time of the running
requests summed across engines, and `mean_running` is the sum of each engine's time-weighted mean.
`steps` and `preemptions` are summed over engines. With one replica the summary is exactly the one
`zipage replay` prints, plus the TTFT percentiles of sessions' follow-up turns alone
(`followup_ttft_p50_s`, ...: what `zipage plan` holds to `--slo-followup-ttft-p90`).
"""

from __future__ import annotations

import time
from collections import Counter

import simpy

from zipage.core.arrivals import ArrivalQueue
from zipage.core.deployment import ReplaySettings, trace_sequences
from zipage.core.metrics import percentile, summarize
from zipage.core.routing import ROUND_ROBIN, ROUTING_POLICIES, ReplicaLoad, RoundRobin, make_policy
from zipage.core.sequence import Sequence, SequenceStatus
from zipage.errors import ConfigError
from zipage.records import StepRecord
from zipage.sim.simulate import plan_deployment
from zipage.sim.simulator import Simulator, feed
from zipage.trace import Trace


def simulate_cluster(trace: Trace, settings: ReplaySettings, replicas: int = 1,
                     routing: str = ROUND_ROBIN) -> dict:
    """Replay `trace` on `replicas` engines of `settings` behind a `routing` router.

    Returns the merged summary (see the module docstring) with the capacity of one engine
    (`num_blocks`, `max_concurrency`), the cluster's shape (`replicas`, `routing`,
    `requests_per_replica`) and `first_error`, the reason the first rejected request could never
    be served (None when none was). Raises a `ZipageError` when the settings cannot be planned.
    """
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
        raise ConfigError(f"replicas: got {replicas!r}, expected an integer >= 1 (e.g. 2)")
    if routing not in ROUTING_POLICIES:
        raise ConfigError(f"routing: got {routing!r}, expected one of "
                          f"{', '.join(ROUTING_POLICIES)}")
    started = time.perf_counter()
    deployment = plan_deployment(settings)
    environment = simpy.Environment()
    engines = [Simulator(deployment.new_scheduler(), deployment.cost_model, env=environment)
               for _ in range(replicas)]
    sequences = trace_sequences(trace, deployment.shape.vocab_size, need_tokens=False,
                                scheduler=engines[0].scheduler, block_keys=True)
    # The one arrival rule of every driver (a session's next turn comes after its predecessor
    # finished, on whichever engine ran it); every engine tells the queue of its finishes.
    arrivals = ArrivalQueue(sequences, users=settings.users)
    for engine in engines:
        engine.recorder.follow(arrivals)
    loops = [engine.start() for engine in engines]
    router = _Router(engines, make_policy(routing, replicas))
    environment.process(_route(environment, arrivals, router))
    environment.run(until=simpy.AllOf(environment, loops))
    assignment = router.assignment

    runs = [engine.result() for engine in engines]
    steps = [step for run in runs for step in run.steps]
    requests = [request for run in runs for request in run.requests]
    summary = summarize(steps, requests)
    summary.update(followup_ttft_percentiles(sequences))
    if replicas > 1:
        summary["peak_running"] = peak_concurrent_running([run.steps for run in runs])
        summary["mean_running"] = sum(run.summary["mean_running"] for run in runs)
    counts = Counter(assignment)
    errors = [request.error for request in requests if request.error]
    summary.update(replicas=replicas, routing=routing,
                   requests_per_replica=[counts[index] for index in range(replicas)],
                   first_error=errors[0] if errors else None,
                   wall_s=time.perf_counter() - started)
    return deployment.summary(summary, settings)


def followup_ttft_percentiles(sequences: list[Sequence]) -> dict[str, float | None]:
    """TTFT p50, p90 and p99 over the finished follow-up turns of sessions (a turn that follows
    another), None without any. A follow-up's `arrival_s` is when it came due, its
    predecessor's finish plus its `after_s` (`ArrivalQueue.admit_due` sets it), so its TTFT is
    what its user waited after sending it, not since the session began. The sequences are held
    here anyway; what is kept besides is one float per follow-up, sorted as `summarize` sorts
    the TTFTs of all turns."""
    ordered = sorted(seq.first_token_time - seq.arrival_s for seq in sequences
                     if seq.turn is not None and seq.turn.follows is not None
                     and seq.status is SequenceStatus.FINISHED)
    return {f"followup_ttft_p{percent}_s": percentile(ordered, percent, True) if ordered else None
            for percent in (50, 90, 99)}


def peak_concurrent_running(step_lists: list[list[StepRecord]]) -> int:
    """Peak over time of the running requests summed across engines.

    Each engine's step records form a piecewise-constant count over [t_start, t_end); a sweep
    over the step boundaries adds the engines up. At an instant where one step ends and another
    begins, the end is applied first, so an engine's consecutive steps are never counted twice.
    """
    events: list[tuple[float, int, int]] = []
    for steps in step_lists:
        for step in steps:
            events.append((step.t_start, 1, step.n_running))
            events.append((step.t_end, 0, -step.n_running))
    running = peak = 0
    for _, _, change in sorted(events):
        running += change
        peak = max(peak, running)
    return peak


class _Router:
    """The router: each request that comes due goes to one engine, by the policy."""

    def __init__(self, engines: list[Simulator], policy: RoundRobin) -> None:
        self.engines, self.policy = engines, policy
        self.assignment: list[int] = []

    def add(self, seq: Sequence) -> bool:
        keys = seq.prompt_block_hashes
        session = seq.turn.session if seq.turn else None  # (a trace's; None on its own)
        engines = self.engines
        index = self.policy.choose(keys, [
            ReplicaLoad(engine.load, engine.scheduler.block_manager.num_used_blocks)
            for engine in engines], session)
        self.policy.routed(index, keys, session)
        self.assignment.append(index)
        return engines[index].submit(seq)

    def refuse(self, seq: Sequence, reason: str) -> None:
        self.engines[0].refuse(seq, reason)  # (a request never routed: any engine records it)


def _route(environment: simpy.Environment, arrivals: ArrivalQueue, router: _Router):
    """The router process: each request goes to one engine when it comes due."""
    yield from feed(environment, arrivals, router)
    for engine in router.engines:
        engine.close()
