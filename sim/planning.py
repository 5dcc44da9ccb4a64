"""Capacity planning: search deployments of a trace with the simulator (`zipage plan`).

A `PlanSpec` names the axes of the search (GPU, KV budget, budget policy, block size, cache
memory, hybrid scheduling, replicas, arrival rate) and the objective: throughput, throughput per
dollar, the highest arrival rate that still meets the latency SLOs, or, for a trace of sessions,
the most concurrent users that do. Each grid point (`PlanPoint`) is evaluated by
`evaluate_point`, a pure function of the trace and the point that runs the simulator
(`zipage.sim.cluster.simulate_cluster`) once or, for the max-rate objective, bisects over Poisson
arrival rates as Vidur-Search does (for max-users, over integer user counts); a point the
config, the memory planner or the scheduler refuses is kept as infeasible with the `ZipageError`
message as its reason. Each SLO verdict is
meets, misses or uncertain (sim/slo.py): uncertain where the target lies within the validated
error band of the profile that priced the point. Because points are pure, the executor (serial,
a local process pool, Ray tasks) cannot change a result, and finished points are cached under a
stable hash of the trace's content, the point and the simulator's source, so an interrupted
search resumes and a rerun costs nothing. `run_plan` ranks the rows and
marks, per GPU, the Pareto front of the objective against the budget, which stands in for
accuracy (the paper's trade-off).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import xxhash

from zipage.core.deployment import ReplaySettings
from zipage.errors import ConfigError, ZipageError
from zipage.profile import VALIDATION_METRICS
from zipage.sim.slo import FOLLOWUP_TTFT_P90, MISSES, SLO, UNCERTAIN
from zipage.trace import ARRIVAL_PATTERNS, Trace, scale_arrivals, stamp_arrivals

TPS = "tps"
TPS_PER_DOLLAR = "tps-per-dollar"
MAX_RATE = "max-rate"
MAX_USERS = "max-users"
OBJECTIVES = (TPS, TPS_PER_DOLLAR, MAX_RATE, MAX_USERS)
OBJECTIVE_COLUMN = {TPS: "tps", TPS_PER_DOLLAR: "tps_per_dollar", MAX_RATE: "max_rate_qps",
                    MAX_USERS: "max_users"}
# The objectives that search a load (a rate, a number of users) for the highest meeting the SLOs.
SEARCHED = (MAX_RATE, MAX_USERS)

SERIAL = "serial"
LOCAL = "local"
RAY = "ray"
EXECUTORS = (SERIAL, LOCAL, RAY)

OK = "ok"
# Meets the SLOs as predicted, but some target lies within the cost model's validated error band
# of the prediction (sim/slo.py): the engine may miss it.
SLO_UNCERTAIN = "slo-uncertain"
SLO_MISSED = "slo-missed"
INFEASIBLE = "infeasible"
STATUS_ORDER = {OK: 0, SLO_UNCERTAIN: 1, SLO_MISSED: 2, INFEASIBLE: 3}

CACHE_SUBDIR = Path(".zipage-cache") / "plan"

# The simulation's headline numbers a row keeps (the names of `summarize` and `run_summary`).
METRIC_KEYS = (
    "requests", "completed", "failed", "output_tokens", "makespan_s", "tps",
    "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms",
    # Over sessions' follow-up turns only (sim/cluster.py); None for a trace without any.
    "followup_ttft_p50_s", "followup_ttft_p90_s", "followup_ttft_p99_s",
    "mean_ttft_s", "mean_tpot_ms", "peak_running", "mean_running", "preemptions",
    "compressions", "mean_kept_budget", "n_max", "max_concurrency", "num_blocks",
)
# A row's figures with a validated metric: the summary key -> the validation metric. A follow-up
# TTFT percentile takes the band of the same percentile over all turns (sim/slo.py says why).
BANDED = {key: metric for metric, key in VALIDATION_METRICS.items() if key is not None}
BANDED.update({f"followup_{key}": BANDED[key] for key in ("ttft_p50_s", "ttft_p90_s",
                                                          "ttft_p99_s")})
RESULT_COLUMNS = [
    "rank", "status", "reason", "hardware", "budget", "budget_policy", "block_size", "hybrid",
    "replicas",
    "routing", "kv_memory_gb", "gpu_memory_utilization", "rate_qps", "speedup", "users",
    "objective", "objective_value", "pareto", "arrival_capped", "tps", "tps_per_dollar",
    "max_rate_qps",
    # max-users: the answer, the trace's sessions (a request in no session is one) and, with
    # `users` above, the count the row's metrics were simulated at.
    "max_users", "sessions", "gpus",
    "price_per_hour_usd", *[key for key in METRIC_KEYS if key != "tps"], "simulations", "key",
    # How far to trust the row (empty: the cost model has no validated band): the held-out
    # workload the profile was validated on, each SLO's verdict, and each figure's band.
    "validated_on", "slo_verdicts", *[f"{key}_band" for key in METRIC_KEYS if key in BANDED],
]


@dataclass(frozen=True)
class RateSearch:
    """How the max-rate objective searches: from `start_qps` (default: the offline request
    throughput), doubling or halving until the SLOs flip, then bisecting until the bracket is
    narrower than `tolerance` of its upper end, within `max_simulations` simulations (which
    bounds the max-users search as well; `start_qps` and `tolerance` do not apply to it)."""

    start_qps: float | None = None
    tolerance: float = 0.05
    max_simulations: int = 16


@dataclass(frozen=True)
class PlanPoint:
    """One deployment: the axis values on top of the base settings, how many engines, and the
    arrivals. `rate_qps` None replays the trace's own arrival times (all 0 for an offline trace),
    divided by `speedup` when it is set (a production trace played faster: its own burstiness,
    more load).
    """

    base: ReplaySettings
    hardware: str
    budget: int
    block_size: int
    hybrid: bool
    kv_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    replicas: int = 1
    routing: str = "least-loaded"
    rate_qps: float | None = None
    arrivals: str = "poisson"
    arrival_seed: int = 0
    burst_size: int = 8
    budget_policy: str = "fixed"
    speedup: float | None = None

    def settings(self) -> ReplaySettings:
        """The settings of one engine; raises `ConfigError` for an invalid combination (a
        budget that is not a multiple of the block size), which makes the point infeasible."""
        from zipage.config import ZipageConfig

        config = ZipageConfig.from_dict({**self.base.config.to_dict(), "kv_budget": self.budget,
                                         "block_size": self.block_size, "hybrid": self.hybrid,
                                         "budget_policy": self.budget_policy})
        return dataclasses.replace(self.base, hardware=self.hardware, config=config,
                                   kv_memory_gb=self.kv_memory_gb,
                                   gpu_memory_utilization=self.gpu_memory_utilization)

    def labels(self) -> dict:
        """The point's coordinates as result columns."""
        return {
            "hardware": self.hardware, "budget": self.budget,
            "budget_policy": self.budget_policy, "block_size": self.block_size,
            "hybrid": self.hybrid, "replicas": self.replicas, "routing": self.routing,
            "kv_memory_gb": self.kv_memory_gb,
            "gpu_memory_utilization": (None if self.kv_memory_gb is not None
                                       else self.gpu_memory_utilization),
            "rate_qps": self.rate_qps, "speedup": self.speedup, "users": self.base.users,
        }

    def key_fields(self) -> dict:
        """Everything of the point an outcome depends on, for the cache key."""
        values = dataclasses.asdict(self)
        values["base"] = self.base.to_dict()
        if values["speedup"] is None:  # points from before the axis keep their cache keys
            del values["speedup"]
        return values


@dataclass
class PlanSpec:
    """The search: every combination of the axis lists, one objective, optional SLOs.

    `base` holds every knob that is not an axis. `kv_memory_gb` set replaces the
    `gpu_memory_utilization` axis (exact cache memory, as `--kv-memory-gb`). With the max-rate
    objective the rate is searched, so `rates` holds at most the starting guess; with max-users
    the number of users (`base.users`) is, on the trace's sessions all starting at 0, so neither
    a rate nor a speed-up applies."""

    base: ReplaySettings = field(default_factory=ReplaySettings)
    hardware: list[str] = field(default_factory=lambda: ["a100-80gb"])
    budgets: list[int] = field(default_factory=lambda: [2048])
    budget_policies: list[str] = field(default_factory=lambda: ["fixed"])
    block_sizes: list[int] = field(default_factory=lambda: [256])
    hybrid: list[bool] = field(default_factory=lambda: [True])
    kv_memory_gb: list[float] | None = None
    gpu_memory_utilization: list[float] = field(default_factory=lambda: [0.9])
    replicas: list[int] = field(default_factory=lambda: [1])
    rates: list[float | None] = field(default_factory=lambda: [None])
    speedups: list[float | None] = field(default_factory=lambda: [None])
    routing: str = "least-loaded"
    arrivals: str = "poisson"
    arrival_seed: int = 0
    burst_size: int = 8
    objective: str = TPS
    slo: SLO = field(default_factory=SLO)
    search: RateSearch = field(default_factory=RateSearch)

    def validate(self, trace: Trace | None = None) -> None:
        """Mistakes in the search itself, and with `trace` its mismatches with the trace, fail
        before anything runs (and GPU names are normalised); a bad combination of otherwise
        valid values (a budget that is not a multiple of the block size) is one infeasible
        point instead."""
        from zipage.core.routing import ROUTING_POLICIES
        from zipage.hardware import get_hardware
        from zipage.model_spec import resolve_shape

        resolve_shape(self.base.model)
        self.hardware = _unique([get_hardware(name).name for name in self.hardware])
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"objective: got {self.objective!r}, expected one of "
                              f"{', '.join(OBJECTIVES)}")
        if self.objective == MAX_RATE:
            if not self.slo.active:
                raise ConfigError("objective max-rate: the highest rate that meets the SLOs needs "
                                  "an SLO; add --slo-ttft-p90 SECONDS and/or --slo-tpot-p99 MS")
            if len(self.rates) > 1:
                raise ConfigError("rate: the max-rate objective searches the rate itself; give "
                                  "at most one --rate, the starting guess")
            if self.speedups != [None]:
                raise ConfigError("speedup: the max-rate objective searches a Poisson rate; "
                                  "drop --speedup, or rank the speed-ups with --objective tps")
        if self.objective == MAX_USERS:
            if not self.slo.active:
                raise ConfigError("objective max-users: the most users that meet the SLOs needs "
                                  "an SLO; add --slo-ttft-p90 SECONDS and/or --slo-tpot-p99 MS")
            if self.rates != [None]:
                raise ConfigError("rate: the max-users objective starts every session at 0 and "
                                  "searches the number of users; drop --rate")
            if self.speedups != [None]:
                raise ConfigError("speedup: the max-users objective starts every session at 0 "
                                  "and searches the number of users; drop --speedup")
            if self.base.users is not None:
                raise ConfigError("users: the max-users objective searches the number of users "
                                  "itself; drop --users")
        if self.speedups != [None] and self.rates != [None]:
            raise ConfigError("speedup and rate: --speedup plays the trace's own arrival times "
                              "faster, --rate stamps new Poisson ones; give one of them")
        if self.routing not in ROUTING_POLICIES:
            raise ConfigError(f"routing: got {self.routing!r}, expected one of "
                              f"{', '.join(ROUTING_POLICIES)}")
        if self.arrivals not in ARRIVAL_PATTERNS:
            raise ConfigError(f"arrivals: got {self.arrivals!r}, expected one of "
                              f"{', '.join(ARRIVAL_PATTERNS)}")
        for name, values in (("budget", self.budgets), ("block_size", self.block_sizes),
                             ("replicas", self.replicas)):
            if not values or any(not isinstance(value, int) or value < 1 for value in values):
                raise ConfigError(f"{name}: got {values!r}, expected integers >= 1")
        for name, values in (("kv_memory_gb", self.kv_memory_gb or [1.0]),
                             ("rate", [rate for rate in self.rates if rate is not None] or [1.0]),
                             ("speedup", [factor for factor in self.speedups
                                          if factor is not None] or [1.0])):
            if any(not value > 0 or not math.isfinite(value) for value in values):
                raise ConfigError(f"{name}: got {values!r}, expected finite numbers > 0")
        for target, value in self.slo.set_targets():
            if not value > 0:
                raise ConfigError(target.bad_value(value))
        if (trace is not None and self.slo.followup_ttft_p90_s is not None
                and count_sessions(trace) == len(trace.requests)):
            # Vacuously met would pass a deployment on a target nothing was measured against.
            flag = FOLLOWUP_TTFT_P90.flag
            raise ConfigError(f"{flag}: trace {trace.name!r} has no follow-up turns (no request "
                              f"has `after`), so no follow-up TTFT to hold to a target; drop "
                              f"{flag}, or plan a trace of sessions (docs/traces.md, 'Sessions')")
        from zipage.config import BUDGET_POLICIES

        if not self.budget_policies or any(policy not in BUDGET_POLICIES
                                           for policy in self.budget_policies):
            raise ConfigError(f"budget_policy: got {self.budget_policies!r}, expected some of "
                              f"{', '.join(BUDGET_POLICIES)}")
        if not isinstance(self.search.max_simulations, int) or self.search.max_simulations < 1:
            raise ConfigError(f"max_simulations: got {self.search.max_simulations!r}, expected "
                              "an integer >= 1")
        if not 0 < self.search.tolerance < 1:
            raise ConfigError(f"rate tolerance: got {self.search.tolerance!r}, expected a share "
                              "between 0 and 1 (e.g. --rate-tolerance 0.05)")

    def points(self) -> list[PlanPoint]:
        """The grid in a fixed order (GPU, budget, budget policy, block size, hybrid, memory,
        replicas, rate, speed-up)."""
        memories: list[tuple[float | None, float]] = (
            [(gigabytes, self.base.gpu_memory_utilization) for gigabytes in self.kv_memory_gb]
            if self.kv_memory_gb is not None
            else [(None, utilization) for utilization in self.gpu_memory_utilization])
        rates = [None] if self.objective in SEARCHED else self.rates
        return [
            PlanPoint(self.base, hardware, budget, block_size, hybrid, kv_gb, utilization,
                      replicas, self.routing, rate, self.arrivals, self.arrival_seed,
                      self.burst_size, policy, speedup)
            for (hardware, budget, policy, block_size, hybrid, (kv_gb, utilization), replicas,
                 rate, speedup)
            in itertools.product(self.hardware, self.budgets, self.budget_policies,
                                 self.block_sizes, self.hybrid, memories, self.replicas, rates,
                                 self.speedups)
        ]


@dataclass(frozen=True)
class PointTask:
    """What a worker needs besides the trace: the point and how to evaluate it."""

    point: PlanPoint
    objective: str = TPS
    slo: SLO = SLO()
    search: RateSearch = RateSearch()


@dataclass
class PlanResult:
    rows: list[dict]  # every point, ranked; infeasible ones last, with their reason
    evaluated: int  # points simulated in this run
    cached: int  # points read from the cache
    wall_s: float
    # The validation record (`Validation.summary()`) of the profile that priced the feasible
    # points (one --cost-model prices them all); None: no point was priced by a validated one.
    validation: dict | None = None

    @property
    def pareto(self) -> list[dict]:
        """The Pareto front of every GPU, each sorted by budget."""
        front = [row for row in self.rows if row["pareto"]]
        return sorted(front, key=lambda row: (row["hardware"], row["budget"]))


# ---------------------------------------------------------------- evaluating one point

def evaluate_point(trace: Trace, task: PointTask) -> dict:
    """Simulate one point: its metrics, or `feasible` False with the reason.

    A pure function of its arguments (the simulator is deterministic), so any executor, on any
    worker, returns the same outcome."""
    try:
        if task.objective == MAX_RATE:
            return _search_max_rate(trace, task)
        if task.objective == MAX_USERS:
            return _search_max_users(trace, task)
        return {**_simulate(_arrivals(trace, task.point, task.point.rate_qps), task.point),
                "simulations": 1}
    except ZipageError as error:
        return {"feasible": False, "reason": str(error), "simulations": 1}


# A point is arrival-capped (`arrival_capped`) when its arrival span (first to last arrival)
# covers at least ARRIVAL_CAP_SHARE of its makespan, i.e. its tok/s is within 10 % of the trace's
# offered output tokens / arrival span. No deployment finishes before the last arrival, so no
# deployment, however fast, could raise that tok/s by more than 1 / 0.9 - 1 = 11 %: the figure
# measures the trace's pace, not the deployment. An all-at-once trace (span 0) never is. Rules
# that allowed for the last requests' own decoding (at the run's TPOT) flagged overloaded points
# too: a slow deployment's TPOT stretches that allowance with its makespan.
ARRIVAL_CAP_SHARE = 0.9


def arrival_capped(trace: Trace, makespan_s: float) -> bool:
    """Whether the trace's arrival times capped a run's throughput (the rule above). A
    follow-up turn's `arrival_s` is its session's start, earlier than it comes due in any run,
    so a trace of sessions is judged on a span no deployment can beat either."""
    if not trace.requests or makespan_s <= 0:
        return False
    arrivals = [request.arrival_s for request in trace.requests]
    return max(arrivals) - min(arrivals) >= ARRIVAL_CAP_SHARE * makespan_s


def _simulate(trace: Trace, point: PlanPoint) -> dict:
    from zipage.sim.cluster import simulate_cluster

    summary = simulate_cluster(trace, point.settings(), point.replicas, point.routing)
    outcome = {key: summary[key] for key in METRIC_KEYS}
    outcome["arrival_capped"] = arrival_capped(trace, summary["makespan_s"])
    # The cost model's validated errors, where the point was priced with a validated profile.
    outcome["validation"] = summary["validation"]
    if summary["failed"]:
        # A deployment that cannot serve some requests of the workload at all does not fit it.
        outcome.update(feasible=False, reason=(
            f"{summary['failed']} of {summary['requests']} requests can never be served: "
            f"{summary['first_error']}"))
    else:
        outcome.update(feasible=True, reason=None)
    return outcome


def bands_of(outcome: dict) -> dict[str, float | None] | None:
    """The validated bands of the cost model an outcome was simulated with, by validation
    metric (None: it has none)."""
    validation = outcome.get("validation")
    return None if validation is None else validation["bands"]


def _arrivals(trace: Trace, point: PlanPoint, rate_qps: float | None) -> Trace:
    if rate_qps is None:
        return trace if point.speedup is None else scale_arrivals(trace, point.speedup)
    return stamp_arrivals(trace, rate_qps, pattern=point.arrivals, seed=point.arrival_seed,
                          burst_size=point.burst_size)


def _search_max_rate(trace: Trace, task: PointTask) -> dict:
    """The highest arrival rate whose simulated latencies meet the SLOs.

    The stamped arrival times at rate r are those at rate 1 divided by r (same seed, same
    draws), so raising the rate only compresses time; queues, hence TTFT and TPOT, grow with it.
    All requests arriving at once is the limit of an infinite rate: if even that meets the SLOs,
    the answer is infinity. Otherwise bracket the answer by doubling or halving from the start
    rate, then bisect. The row reports the metrics at the rate found.
    """
    point, slo, search = task.point, task.slo, task.search
    offline = _simulate(Trace(trace.name, [dataclasses.replace(request, arrival_s=0.0)
                                           for request in trace.requests]), point)
    simulations = 1
    # With a validated profile, "meets" is sure to within the band (sim/slo.py): the rate found
    # is the highest whose predicted latencies meet the SLOs even if they are off by the band.
    if not offline["feasible"] or slo.meets(offline, bands_of(offline)):
        return {**offline, "max_rate_qps": math.inf if offline["feasible"] else None,
                "rate_qps": None, "simulations": simulations}
    outcomes: dict[float, dict] = {}

    def meets(rate: float) -> bool:
        nonlocal simulations
        simulations += 1
        outcomes[rate] = _simulate(_arrivals(trace, point, rate), point)
        return outcomes[rate]["feasible"] and slo.meets(outcomes[rate], bands_of(outcomes[rate]))

    rate = search.start_qps or offline["completed"] / offline["makespan_s"]
    lowest = rate / 1024
    low: float | None = None
    high: float | None = None
    if meets(rate):
        low = rate
        while high is None and simulations < search.max_simulations:
            rate *= 2
            if meets(rate):
                low = rate
            else:
                high = rate
    else:
        high = rate
        while low is None and rate > lowest and simulations < search.max_simulations:
            rate /= 2
            if meets(rate):
                low = rate
            else:
                high = rate
    if low is None:
        return {**outcomes[high], "feasible": True, "reason": None, "max_rate_qps": 0.0,
                "rate_qps": high, "simulations": simulations}
    while (high is not None and high - low > search.tolerance * high
           and simulations < search.max_simulations):
        middle = (low + high) / 2
        if meets(middle):
            low = middle
        else:
            high = middle
    return {**outcomes[low], "max_rate_qps": low, "rate_qps": low, "simulations": simulations}


def count_sessions(trace: Trace) -> int:
    """The sessions of a trace as `--users` counts them: each request that follows no other
    starts one (a request in no session is a session of one turn)."""
    return sum(request.after is None for request in trace.requests)


def _search_max_users(trace: Trace, task: PointTask) -> dict:
    """The most concurrent users whose simulated latencies meet the SLOs.

    The run at N users is the trace with every session starting at 0 and `users=N`: N users
    working back to back through the sessions in trace order, each sending a session's next turn
    only after the previous answer (closed loop). With as many users as sessions none waits for
    a user and more cannot add load, so that count is simulated first: if it meets the SLOs, it
    is the answer. Otherwise 1 is tried (missing even there: the answer is 0, the row's metrics
    those at 1), then the count doubles until the SLOs flip (the session count bounding it), and
    the bracket is bisected on integers, within `max_simulations` simulations. Like max-rate, the
    search assumes latency does not fall as users are added. The row reports the metrics at the
    count found (`users`).
    """
    point, slo, search = task.point, task.slo, task.search
    closed = Trace(trace.name, [dataclasses.replace(request, arrival_s=0.0)
                                for request in trace.requests])
    sessions = count_sessions(trace)
    outcomes: dict[int, dict] = {}
    simulations = 0

    def meets(users: int) -> bool:
        nonlocal simulations
        simulations += 1
        outcome = _simulate(closed, dataclasses.replace(
            point, base=dataclasses.replace(point.base, users=users)))
        outcomes[users] = outcome
        return outcome["feasible"] and slo.meets(outcome, bands_of(outcome))

    def answer(users: int, found: int | None) -> dict:
        return {**outcomes[users], "max_users": found, "users": users, "sessions": sessions,
                "simulations": simulations}

    if meets(sessions) or not outcomes[sessions]["feasible"]:
        # All sessions at once meet the SLOs, or the deployment cannot serve some request at all
        # (a prompt too long for it: no number of users changes that).
        return answer(sessions, sessions if outcomes[sessions]["feasible"] else None)
    high = sessions  # misses
    if sessions == 1 or simulations >= search.max_simulations or not meets(1):
        return answer(1 if 1 in outcomes else sessions, 0)
    low = 1  # meets
    while 2 * low < high and simulations < search.max_simulations:
        if meets(2 * low):
            low *= 2
        else:
            high = 2 * low
    while high - low > 1 and simulations < search.max_simulations:
        middle = (low + high) // 2
        if meets(middle):
            low = middle
        else:
            high = middle
    return answer(low, low)


# ---------------------------------------------------------------- running a search

def run_plan(trace: Trace, spec: PlanSpec, *, executor: str = LOCAL, workers: int | None = None,
             ray_address: str | None = None, cache_dir: str | Path | None = None,
             progress: bool = False) -> PlanResult:
    """Evaluate every point of `spec` on `trace` (cached points are read, not simulated) and
    return the ranked rows with the Pareto front marked."""
    started = time.perf_counter()
    spec.validate(trace)
    if executor not in EXECUTORS:
        raise ConfigError(f"executor: got {executor!r}, expected one of {', '.join(EXECUTORS)}")
    points = spec.points()
    tasks = [PointTask(point, spec.objective, spec.slo, spec.search) for point in points]
    context = plan_context(trace, spec.base)
    keys = [point_key(context, task) for task in tasks]
    cache = Path(cache_dir) if cache_dir is not None else None
    outcomes: dict[int, dict] = {}
    if cache is not None:
        for index, key in enumerate(keys):
            cached = _read_cache(cache, key)
            if cached is not None:
                outcomes[index] = cached
    missing = [index for index in range(len(tasks)) if index not in outcomes]

    bar = _progress_bar(len(tasks), len(tasks) - len(missing), progress)

    def finished(index: int, outcome: dict) -> None:
        # Cached as soon as it arrives, so an interrupted search keeps every finished point.
        outcomes[index] = outcome
        if cache is not None:
            _write_cache(cache, keys[index], outcome)
        bar.update(1)

    try:
        if missing:
            _EXECUTE[executor](trace, [(index, tasks[index]) for index in missing], finished,
                               workers=workers, ray_address=ray_address)
    finally:
        bar.close()
    rows = [_row(point, outcomes[index], keys[index], spec)
            for index, point in enumerate(points)]
    validation = next((outcome["validation"] for outcome in outcomes.values()
                       if outcome["feasible"] and outcome.get("validation")), None)
    return PlanResult(rank_rows(rows, spec.objective), evaluated=len(missing),
                      cached=len(tasks) - len(missing), wall_s=time.perf_counter() - started,
                      validation=validation)


Callback = Callable[[int, dict], None]


def _run_serial(trace: Trace, tasks: list[tuple[int, PointTask]], done: Callback,
                **_options) -> None:
    for index, task in tasks:
        done(index, evaluate_point(trace, task))


def _run_local(trace: Trace, tasks: list[tuple[int, PointTask]], done: Callback, *,
               workers: int | None = None, **_options) -> None:
    workers = min(workers or os.cpu_count() or 1, len(tasks))
    if workers == 1:
        _run_serial(trace, tasks, done)
        return
    pool = ProcessPoolExecutor(max_workers=workers)
    try:
        futures = {pool.submit(evaluate_point, trace, task): index for index, task in tasks}
        for future in as_completed(futures):
            done(futures[future], future.result())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _run_ray(trace: Trace, tasks: list[tuple[int, PointTask]], done: Callback, *,
             ray_address: str | None = None, **_options) -> None:
    try:
        import ray
    except ImportError as error:
        raise ConfigError("--ray: Ray is not installed; pip install 'zipage[ray]' (or pip "
                          "install ray), or drop --ray to use the local process pool") from error
    started_here = not ray.is_initialized()
    if started_here:
        if ray_address:
            ray.init(address=ray_address)
        else:
            # Joins the instance RAY_ADDRESS names or a running local one, else starts one; a
            # planning run has no use for the dashboard's extra processes.
            ray.init(include_dashboard=False)
    try:
        evaluate_remote = ray.remote(evaluate_point)
        trace_reference = ray.put(trace)  # shipped to the object store once, not per task
        pending = {evaluate_remote.remote(trace_reference, task): index for index, task in tasks}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for reference in ready:
                done(pending.pop(reference), ray.get(reference))
    finally:
        if started_here:
            ray.shutdown()


_EXECUTE = {SERIAL: _run_serial, LOCAL: _run_local, RAY: _run_ray}


# ---------------------------------------------------------------- rows, ranking, Pareto front

def _row(point: PlanPoint, outcome: dict, key: str, spec: PlanSpec) -> dict:
    from zipage.hardware import get_hardware

    row = dict.fromkeys(RESULT_COLUMNS)
    row.update(point.labels())
    row.update({name: value for name, value in outcome.items() if name in row})
    gpu = get_hardware(point.hardware)
    gpus = point.replicas * point.base.tensor_parallel
    row.update(objective=spec.objective, gpus=gpus,
               price_per_hour_usd=gpus * gpu.price_per_hour_usd,
               simulations=outcome["simulations"], key=key, pareto=False)
    if not outcome["feasible"]:
        row.update(status=INFEASIBLE, reason=outcome["reason"])
        return row
    # Throughput per dollar: tokens per second for each dollar per hour the GPUs cost.
    row["tps_per_dollar"] = row["tps"] / row["price_per_hour_usd"]
    bands = bands_of(outcome)
    if bands is not None:
        row["validated_on"] = outcome["validation"]["workload"]
        # (No band beside a figure the run has none of: follow-up TTFT without follow-ups.)
        row.update({f"{key}_band": bands[metric] for key, metric in BANDED.items()
                    if row[key] is not None})
    verdicts = spec.slo.verdicts(outcome, bands)
    if verdicts:
        row["slo_verdicts"] = "; ".join(f"{item.name}: {item.verdict}" for item in verdicts)
    missed = [item.describe() for item in verdicts if item.verdict == MISSES]
    uncertain = [item.describe() for item in verdicts if item.verdict == UNCERTAIN]
    if spec.objective == MAX_RATE and row["max_rate_qps"] == 0.0:
        row.update(status=SLO_MISSED, reason=(f"SLOs missed at every rate down to "
                                              f"{row['rate_qps']:.3g} req/s: "
                                              + "; ".join(missed + uncertain)))
    elif spec.objective == MAX_USERS and row["max_users"] == 0:
        row.update(status=SLO_MISSED, reason=(f"SLOs missed even with {row['users']} user"
                                              f"{'s' if row['users'] > 1 else ''}: "
                                              + "; ".join(missed + uncertain)))
    elif missed:
        row.update(status=SLO_MISSED, reason="; ".join(missed))
    elif uncertain:
        row.update(status=SLO_UNCERTAIN, reason="; ".join(uncertain))
    else:
        row.update(status=OK)
    row["objective_value"] = row[OBJECTIVE_COLUMN[spec.objective]]
    return row


def rank_rows(rows: list[dict], objective: str) -> list[dict]:
    """Points meeting the SLOs first, then those whose verdict is uncertain (within the cost
    model's validated band), then those missing them, then infeasible ones; within each group
    the objective, highest first; ties keep the grid order. Marks the Pareto front."""
    ranked = sorted(rows, key=lambda row: (
        STATUS_ORDER[row["status"]],
        -(row["objective_value"] if row["objective_value"] is not None else 0.0)))
    for rank, row in enumerate(ranked, start=1):
        row["rank"] = rank
    for row in pareto_front(ranked):
        row["pareto"] = True
    return ranked


def pareto_front(rows: Iterable[dict]) -> list[dict]:
    """Per GPU, the points meeting the SLOs (surely: an uncertain verdict is not on the front)
    that no other point of that GPU beats on both the budget (higher: more accurate) and the
    objective (higher: better); among points equal on both, only the best ranked. `rows` must
    be in rank order."""
    front: list[dict] = []
    candidates = [row for row in rows if row["status"] == OK]
    for row in candidates:
        dominated = any(
            other is not row and other["hardware"] == row["hardware"]
            and other["budget"] >= row["budget"]
            and other["objective_value"] >= row["objective_value"]
            and (other["budget"] > row["budget"]
                 or other["objective_value"] > row["objective_value"]
                 or other["rank"] < row["rank"])
            for other in candidates)
        if not dominated:
            front.append(row)
    return front


# ---------------------------------------------------------------- the result cache

def plan_context(trace: Trace, base: ReplaySettings) -> dict:
    """What every point's outcome depends on besides its own settings: the trace's content, the
    model's shape, the cost-model profile and the simulator's source code (so a changed
    simulator never serves stale rows)."""
    from zipage.model_spec import resolve_shape

    requests = json.dumps([dataclasses.asdict(request) for request in trace.requests])
    return {
        "trace": xxhash.xxh3_128_hexdigest(requests.encode()),
        "shape": dataclasses.asdict(resolve_shape(base.model)),
        "cost_model": _file_digest(base.cost_model),
        "code": _code_digest(),
    }


def point_key(context: dict, task: PointTask) -> str:
    """A stable hash of the plan context, the point and, for the objectives that search a load
    (max-rate; max-users, with the objective's name), the SLOs and the search parameters that
    steer it: the name of the point's file in the cache. tps and tps-per-dollar rank one
    simulation, so they share it."""
    payload = {
        **context,
        "point": task.point.key_fields(),
        "search": ([dataclasses.asdict(task.slo), dataclasses.asdict(task.search)]
                   if task.objective == MAX_RATE else None),
    }
    if task.objective == MAX_USERS:
        # (Only the bound on simulations steers it; max-rate's keys are as they were.)
        payload["search"] = {"objective": MAX_USERS, "slo": dataclasses.asdict(task.slo),
                             "max_simulations": task.search.max_simulations}
    return xxhash.xxh3_128_hexdigest(json.dumps(payload, sort_keys=True).encode())


def _file_digest(path_text: str) -> str:
    """The content hash of a cost-model profile file; the spec itself when it is not a file
    ("analytic", or a shipped profile, which the code digest covers)."""
    path = Path(path_text)
    if not path.is_file():
        return path_text
    return xxhash.xxh3_128_hexdigest(path.read_bytes())


def _code_digest() -> str:
    """A hash of the sources a simulated outcome depends on, computed once per process."""
    global _CODE_DIGEST
    if _CODE_DIGEST is None:
        from zipage import errors

        package = Path(errors.__file__).parent  # the foundation modules beside errors.py
        simulator = Path(__file__).parent
        foundation = ("config.py", "shape.py", "dtypes.py", "hardware.py", "presets.py", "trace.py",
                      "profile.py", "decode_grid.py", "prefill_buckets.py")
        files = [*(package / name for name in foundation),
                 *sorted((package / "core").glob("*.py")), *sorted(simulator.rglob("*.py")),
                 *sorted(simulator.rglob("*.json"))]
        digest = xxhash.xxh3_128()
        for path in files:
            digest.update(f"{path.parent.name}/{path.name}".encode())
            digest.update(path.read_bytes())
        _CODE_DIGEST = digest.hexdigest()
    return _CODE_DIGEST


_CODE_DIGEST: str | None = None


def _read_cache(cache: Path, key: str) -> dict | None:
    path = cache / f"{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        # Missing, or torn by a crash mid-write on a filesystem without atomic rename: recompute.
        return None


def _write_cache(cache: Path, key: str, outcome: dict) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    temporary = cache / f".{key}.{os.getpid()}.tmp"
    temporary.write_text(json.dumps(outcome))
    temporary.replace(cache / f"{key}.json")  # atomic: a reader sees the old file or the new one


# ---------------------------------------------------------------- helpers

def _unique(values: list) -> list:
    return list(dict.fromkeys(values))


class _NoBar:
    def update(self, count: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, already: int, show: bool):
    if not show:
        return _NoBar()
    from zipage.core.recorder import progress_bar

    return progress_bar(total, "points", "pt", initial=already)
