"""The server's Prometheus metrics (GET /metrics): ours, `zipage:`-prefixed, and the same series
again under vLLM's names, so that a dashboard built for vLLM shows a Zipage server.

Gauges are each replica's scheduler state after its latest step, as its engine process reports
it with each step (`wire.EngineStats`), and so are the counters of what only the engine sees
(compressions, preemptions, prefix-cache queries and hits) and each request's time in the
engine's queue; token counters and latency histograms are kept by the HTTP process as each
request's tokens arrive (`engine_client`), so TTFT, inter-token latency and end-to-end latency
count from the request's arrival at the server to the token's arrival back in it. Each server
owns its registry, so several can live in one process (tests).

vLLM's names are not a second set of books: `_VllmNames` renames our series at each scrape
(`VLLM_NAMES`; the label `replica` becomes vLLM's `engine`), so both names always carry the
same values and every update happens once.
"""

from __future__ import annotations

from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.metrics_core import Metric

# Seconds; vLLM's buckets, which cover CPU runs of small models and GPU runs alike.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# Inter-token latency and vLLM's per-request time per output token share these.
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Our series -> vLLM's names for the very same series (vLLM v1, `vllm/v1/metrics/loggers.py`).
# Two where a vLLM dashboard still reads a name vLLM deprecated: its shipped Grafana board reads
# `gpu_cache_usage_perc` (renamed `kv_cache_usage_perc` in 0.9) and `time_per_output_token_seconds`
# (the inter-token latency, renamed `inter_token_latency_seconds` in 0.11). vLLM's per-request
# mean time per output token is `request_time_per_output_token_seconds`, which is what our
# `time_per_output_token_seconds` has always been.
VLLM_NAMES = {
    "zipage:num_requests_running": ("vllm:num_requests_running",),
    "zipage:num_requests_waiting": ("vllm:num_requests_waiting",),
    "zipage:kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "zipage:prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "zipage:prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "zipage:preemptions": ("vllm:num_preemptions",),
    "zipage:prompt_tokens": ("vllm:prompt_tokens",),
    "zipage:generation_tokens": ("vllm:generation_tokens",),
    "zipage:request_success": ("vllm:request_success",),
    "zipage:request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "zipage:request_generation_tokens": ("vllm:request_generation_tokens",),
    "zipage:time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "zipage:inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",
                                           "vllm:time_per_output_token_seconds"),
    "zipage:time_per_output_token_seconds": ("vllm:request_time_per_output_token_seconds",),
    "zipage:e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "zipage:request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
}
# The counters kept by the engine process as totals (`wire.EngineStats` field -> the family).
ENGINE_TOTALS = {"compressions_total": "compressions", "preemptions_total": "preemptions",
                 "prefix_query_tokens_total": "prefix_queries",
                 "prefix_hit_tokens_total": "prefix_hits",
                 "host_hit_tokens_total": "host_hits",
                 "twin_lag_seconds_total": "twin_lag"}
disable_created_metrics()  # no `*_created` series: they double the page and nobody reads them


class ServerMetrics:
    """The server's registry. Everything an engine process does is labelled with its replica
    (`replica="0"` .. `"N-1"` under `--data-parallel N`; `"0"` alone otherwise), so a dashboard
    sums over `replica` for the server and splits by it to find a slow or restarting one;
    refusals before routing (`requests_rejected`) are the server's alone."""

    def __init__(self, model_name: str, num_blocks: int, replicas: int = 1,
                 max_model_len: int | None = None) -> None:
        self.registry = registry = CollectorRegistry()
        self.model_name = model_name
        self.num_blocks = num_blocks
        labels = ["model_name", "replica"]

        def family(kind, name, help, **extra):
            return kind(f"zipage:{name}", help, labels, registry=registry, **extra)

        self.families = {
            "running": family(Gauge, "num_requests_running",
                              "Requests running (holding KV blocks)."),
            "waiting": family(Gauge, "num_requests_waiting", "Requests waiting to be admitted."),
            "blocks_used": family(Gauge, "kv_blocks_used", "KV cache blocks in use."),
            "blocks_free": family(Gauge, "kv_blocks_free", "KV cache blocks free."),
            "kv_usage": family(Gauge, "kv_cache_usage_perc",
                               "KV cache blocks in use, a fraction of all (1 means 100 percent)."),
            "healthy": family(Gauge, "replica_healthy",
                              "1 while the replica's engine process serves, 0 while it is down."),
            "compressions": family(Counter, "compressions", "KV compressions planned."),
            "preemptions": family(Counter, "preemptions",
                                  "Requests preempted (recomputed later)."),
            "prompt_tokens": family(Counter, "prompt_tokens",
                                    "Prompt tokens of requests that started."),
            # vLLM's names and meaning (tokens): hits / queries is the prefix cache's hit rate.
            "prefix_queries": family(Counter, "prefix_cache_queries",
                                     "Prompt tokens the engine needed KV for: computed "
                                     "(recomputation included) or found in the prefix cache."),
            "prefix_hits": family(Counter, "prefix_cache_hits",
                                  "Prompt tokens found in the prefix cache (not computed)."),
            "host_hits": family(Counter, "host_cache_hits",
                                "Of the prefix cache's hits, prompt tokens copied back from the "
                                "host tier's memory (--host-kv-gb)."),
            "generation_tokens": family(Counter, "generation_tokens", "Output tokens generated."),
            "aborted": family(Counter, "requests_aborted", "Requests whose client went away."),
            "routed": family(Counter, "requests_routed", "Requests the router sent here."),
            "restarts": family(Counter, "engine_restarts",
                               "New engine processes started after one died."),
            "twin_lag": family(Counter, "twin_lag_seconds",
                               "--simulate: seconds the twin's steps ended after their predicted "
                               "end (the host fell behind the cost model); 0 for the engine."),
            "ttft": family(Histogram, "time_to_first_token_seconds", "Time to first token.",
                           buckets=TTFT_BUCKETS),
            "itl": family(Histogram, "inter_token_latency_seconds",
                          "Time between a request's consecutive tokens, one per token after "
                          "the first.", buckets=TPOT_BUCKETS),
            "tpot": family(Histogram, "time_per_output_token_seconds",
                           "Mean time per output token after the first, per request.",
                           buckets=TPOT_BUCKETS),
            "e2e": family(Histogram, "e2e_request_latency_seconds", "Arrival to last token.",
                          buckets=E2E_BUCKETS),
            "queue": family(Histogram, "request_queue_time_seconds",
                            "Time in the engine's queue, from arrival there to first admission.",
                            buckets=E2E_BUCKETS),
            "prompt_lengths": family(Histogram, "request_prompt_tokens",
                                     "Prompt tokens per finished request.",
                                     buckets=token_buckets(max_model_len or 2**20)),
            "output_lengths": family(Histogram, "request_generation_tokens",
                                     "Output tokens per finished request.",
                                     buckets=token_buckets(max_model_len or 2**20)),
        }
        self.finished = Counter("zipage:request_success", "Requests finished, by reason.",
                                labels + ["finished_reason"], registry=registry)
        self.rejected = Counter("zipage:requests_rejected", "Requests refused with a 4xx status.",
                                ["model_name"], registry=registry).labels(model_name)
        self.replicas = [ReplicaMetrics(self, str(index)) for index in range(replicas)]
        named = {family.describe()[0].name: family
                 for family in [*self.families.values(), self.finished]}
        registry.register(_VllmNames([(named[ours], theirs)
                                      for ours, theirs in VLLM_NAMES.items()]))

    def replica(self, index: int) -> "ReplicaMetrics":
        return self.replicas[index]

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def sums(self) -> dict[str, float]:
        """Each of our samples summed over its labels (replicas, finish reasons), by sample
        name (`zipage:prompt_tokens_total`, ...): what the stats line reads."""
        totals: dict[str, float] = {}
        for family in [*self.families.values(), self.finished]:
            for metric in family.collect():
                for sample in metric.samples:
                    totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
        return totals


class _VllmNames:
    """A collector of our series under vLLM's names (`VLLM_NAMES`), made at each scrape."""

    def __init__(self, families: list[tuple]) -> None:
        self.families = families  # (our family, its vLLM names)

    def collect(self):
        for family, names in self.families:
            for metric in family.collect():
                for name in names:
                    yield _renamed(metric, name)


def _renamed(metric: Metric, name: str) -> Metric:
    """`metric` named `name`: each sample's suffix (`_total`, `_bucket`, ...) kept, its label
    `replica` called `engine` as vLLM calls one engine of several."""
    copy = Metric(name, metric.documentation, metric.type, metric.unit)
    copy.samples = [sample._replace(
        name=name + sample.name[len(metric.name):],
        labels={("engine" if key == "replica" else key): value
                for key, value in sample.labels.items()}) for sample in metric.samples]
    return copy


def observe_times(histogram: Histogram, amount: float, times: int) -> None:
    """`histogram.observe(amount)` `times` times over, as one update of its sum and one of its
    bucket. prometheus_client has no call for it, so this is its `observe` (0.20-0.26) with a
    count; tests/test_serve_metrics.py checks the page equals that many observations."""
    histogram._raise_if_not_observable()
    histogram._sum.inc(amount * times)
    histogram._buckets[bisect_left(histogram._upper_bounds, amount)].inc(times)


def token_buckets(largest: int) -> list[int]:
    """vLLM's buckets of token counts: 1, 2, 5, 10, 20, 50, ... up to `largest`."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > largest:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class ReplicaMetrics:
    """One replica's series: what its `EngineClient` updates as its engine process reports."""

    def __init__(self, server: ServerMetrics, replica: str) -> None:
        self.num_blocks = server.num_blocks
        self.model_name, self.replica = server.model_name, replica
        for name, family in server.families.items():
            setattr(self, name, family.labels(server.model_name, replica))
        self._finished = server.finished
        self.blocks_free.set(self.num_blocks)
        self.healthy.set(1)
        self._totals = dict.fromkeys(ENGINE_TOTALS, 0)  # the engine's totals seen so far

    def first_token(self, handle) -> None:
        """A request got its first token (its prompt was computed)."""
        self.prompt_tokens.inc(handle.prompt_len)
        self.ttft.observe(handle.first_token_s - handle.arrival_s)
        if handle.queued_s is not None:  # the engine reported its admission
            self.queue.observe(handle.queued_s)

    def inter_token_latencies(self, gaps: dict[float, int]) -> None:
        """One step's inter-token latencies, `gaps[seconds]` tokens each. Most of a step's tokens
        share one gap (their previous token came with the previous step), so each distinct gap is
        observed once for all of them: an observation a token was 6 % of the HTTP process's time
        at 16k streamed tokens a second."""
        for seconds, count in gaps.items():
            observe_times(self.itl, seconds, count)

    def finished_request(self, handle, reason: str, now: float) -> None:
        """A request ended with `reason` ("stop" or "length") at `now` (perf_counter)."""
        self._finished.labels(self.model_name, self.replica, reason).inc()
        self.e2e.observe(now - handle.arrival_s)
        self.prompt_lengths.observe(handle.prompt_len)
        self.output_lengths.observe(handle.num_tokens)
        if handle.num_tokens > 1:
            self.tpot.observe((now - handle.first_token_s) / (handle.num_tokens - 1))

    def engine_stats(self, stats, generated: int) -> None:
        """After each engine step: its tokens and the scheduler's state (`wire.EngineStats`)."""
        self.generation_tokens.inc(generated)
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.blocks_used.set(stats.blocks_used)
        self.blocks_free.set(self.num_blocks - stats.blocks_used)
        self.kv_usage.set(stats.blocks_used / self.num_blocks)
        # The engine reports totals; a counter advances by what is new.
        for field, name in ENGINE_TOTALS.items():
            total = getattr(stats, field)
            getattr(self, name).inc(total - self._totals[field])
            self._totals[field] = total

    def engine_down(self) -> None:
        self.healthy.set(0)

    def engine_restarted(self) -> None:
        """A new engine process: its totals start from zero, and it runs nothing yet."""
        self._totals = dict.fromkeys(ENGINE_TOTALS, 0)
        self.restarts.inc()
        self.healthy.set(1)
        self.running.set(0)
        self.waiting.set(0)
        self.blocks_used.set(0)
        self.blocks_free.set(self.num_blocks)
        self.kv_usage.set(0)
