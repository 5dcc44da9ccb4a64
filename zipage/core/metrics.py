"""Per-step and per-request records (`zipage/records.py`), made the same way by every driver.

Every driver calls `MetricsRecorder.record_step(plan, result)` after `Scheduler.finish`, and
`request_records(scheduler)` at the end. `RunTotals` gathers the summary record by record, so a
streamed run (records written out as they are made, docs/architecture.md, 'Simulator') needs
none of them kept. `summarize` turns both into the summary every report
prints (docs/architecture.md, 'Traces and metrics'): TPS = output tokens / (last finish - first
arrival), and over the same makespan the finished requests per second and their prompt (input)
and prompt + output (total) tokens per second, as vLLM's benchmark counts them; TPOT of a
request = (finish - first token) / (output_len - 1).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable

from zipage.core.sequence import Sequence, SequenceStatus
from zipage.core.step import StepPlan, StepResult
from zipage.records import RequestRecord, StepRecord


class MetricsRecorder:
    """Turns each finished step into its `StepRecord`: kept in `steps`, or, with a `sink`
    (`sink(record)`: a streamed run writes it out), handed on and dropped; with `records` off
    none is made (a run whose summary is all that is wanted). Either way `totals` keeps what the
    summary needs."""

    def __init__(self, num_blocks: int, sink: Callable[[StepRecord], object] | None = None,
                 records: bool = True) -> None:
        self.num_blocks = num_blocks
        self.steps: list[StepRecord] = []
        self.totals = RunTotals()
        self._sink = sink
        self.records = records

    def record_step(self, plan: StepPlan, result: StepResult) -> None:
        # Positional, and no generator for the empty lists of a plain decode step: this runs
        # once a step, millions of times on a day of traffic.
        prefill = plan.prefill
        prefill_tokens = pairs = 0
        sampled = plan.num_decode + len(plan.forks)  # `plan.sampled`, without building it
        for item in prefill:  # one pass, not two generators: a mixed step is common
            prefill_tokens += item.num_new_tokens
            pairs += item.attention_pairs
            sampled += item.samples
        self.totals.add_step(plan.kind, result.t_start, result.t_end, plan.num_running,
                             len(plan.preempted), prefill_tokens, plan.prefix_hit_tokens,
                             plan.host_hit_tokens, len(plan.kv_saves) + len(plan.kv_loads),
                             plan.first_hit_tokens)
        if not self.records:
            return
        launch = plan.compress_launch
        compressions = plan.compress_sync + launch.jobs if launch else plan.compress_sync
        record = StepRecord(
            plan.step_id, result.t_start, result.t_end, plan.kind, len(prefill),
            plan.num_decode, len(compressions), plan.num_running, plan.num_waiting,
            plan.blocks_used, self.num_blocks, plan.slots_used, len(plan.preempted),
            prefill_tokens, plan.decode_context_tokens, len(result.completed_batches), pairs,
            sum(job.num_source_blocks for job in compressions) if compressions else 0,
            plan.prefix_hit_tokens, plan.decode_max_context, plan.shared_kv_tokens,
            plan.host_hit_tokens, len(plan.kv_saves), len(plan.kv_loads), plan.first_hit_tokens,
            result.t_plan if result.t_plan >= 0 else result.t_start, int(result.planned_early),
            int(result.settled_late), sampled)
        if self._sink is None:
            self.steps.append(record)
        else:
            self._sink(record)


def request_record(seq: Sequence) -> RequestRecord:
    # Positional (the fields in RequestRecord's order): this runs once a request. A request
    # that is done is settled: its output count is `settled_output_tokens`.
    return RequestRecord(
        str(seq.seq_id), seq.arrival_s, seq.first_token_time, seq.finish_time, seq.prompt_len,
        # A rejected request never ran: its row keeps the output length it asked for.
        seq.max_output_tokens if seq.error is not None else seq.settled_output_tokens,
        seq.num_preemptions, seq.num_compressions, seq.max_blocks_after_first_compression,
        seq.status._value_, seq.error, seq.kv_budget, seq.kept_budget,  # (`value`, a call)
        seq.priority)


def request_records(sequences: list[Sequence]) -> list[RequestRecord]:
    return [request_record(seq) for seq in sequences]


def summarize(steps: Iterable[StepRecord], requests: Iterable[RequestRecord]) -> dict:
    """The run's headline numbers (keys shared by every driver's `--json`)."""
    totals = RunTotals()
    for s in steps:
        totals.add_step(s.kind, s.t_start, s.t_end, s.n_running, s.preempted, s.prefill_tokens,
                        s.prefix_hit_tokens, s.host_hit_tokens, s.host_saves + s.host_loads,
                        s.first_hit_tokens)
    for request in requests:
        totals.add_request(request)
    return totals.summary()


class RunTotals:
    """What `summarize` needs of a run, gathered one record at a time, so that a streamed run
    (its records written out as they are made) has its summary without keeping them: sums,
    counts and extremes, plus each finished request's TTFT and TPOT (16 bytes a request) for
    the percentiles. Sums are taken in record order, as `sum` over the lists did, so both give
    the same floats."""

    def __init__(self) -> None:
        self.requests = self.done = self.aborted = self.output_tokens = self.input_tokens = 0
        self.first_arrival: float | None = None
        self.last_finish: float | None = None
        self.ttfts, self.tpots = array("d"), array("d")
        self.ttft_sum = self.tpot_sum = 0.0
        self.compressions = self.max_blocks_after_compress = 0
        self.kept_sum, self.kept_count = 0.0, 0
        self.steps = self.busy_steps = self.peak_running = self.running_sum = 0
        self.weighted_time = self.weighted_running = 0.0
        self.preemptions = self.prefill_tokens = self.prefix_hit_tokens = 0
        self.host_hit_tokens = self.host_copies = self.first_hit_tokens = 0

    def add_step(self, kind: str, t_start: float, t_end: float, n_running: int, preempted: int,
                 prefill_tokens: int, prefix_hit_tokens: int, host_hit_tokens: int = 0,
                 host_copies: int = 0, first_hit_tokens: int = 0) -> None:
        """A step's `StepRecord` fields the summary reads (given one by one: a run that keeps
        no step records makes none)."""
        self.steps += 1
        if kind != "idle":
            self.busy_steps += 1
        duration = t_end - t_start
        self.weighted_time += duration
        self.weighted_running += n_running * duration
        self.running_sum += n_running
        if n_running > self.peak_running:
            self.peak_running = n_running
        self.preemptions += preempted
        self.prefill_tokens += prefill_tokens
        self.prefix_hit_tokens += prefix_hit_tokens
        self.host_hit_tokens += host_hit_tokens
        self.first_hit_tokens += first_hit_tokens
        self.host_copies += host_copies

    def add_request(self, r: RequestRecord) -> None:
        if r.status == FINISHED:
            self.add_done(r.arrival, r.first_token, r.finish, r.output_len, r.n_compressions,
                          r.max_blocks_held_after_first_compression, r.kept_budget, r.prompt_len)
            return
        self._add_arrival(r.arrival, r.n_compressions)
        if r.status == ABORTED:
            self.aborted += 1

    def add_done(self, arrival: float, first_token: float, finish: float, output_len: int,
                 n_compressions: int, max_blocks_after_compress: int,
                 kept_budget: float | None, prompt_len: int) -> None:
        """A finished request's `RequestRecord` fields the summary reads (given one by one: a
        run that keeps no request records makes none for a finished request)."""
        self._add_arrival(arrival, n_compressions)
        self.done += 1
        self.output_tokens += output_len
        self.input_tokens += prompt_len
        if self.last_finish is None or finish > self.last_finish:
            self.last_finish = finish
        ttft = first_token - arrival
        self.ttfts.append(ttft)
        self.ttft_sum += ttft
        if output_len > 1:
            tpot = (finish - first_token) / (output_len - 1)
            self.tpots.append(tpot)
            self.tpot_sum += tpot
        if n_compressions and max_blocks_after_compress > self.max_blocks_after_compress:
            self.max_blocks_after_compress = max_blocks_after_compress
        if kept_budget is not None:
            self.kept_sum += kept_budget
            self.kept_count += 1

    def _add_arrival(self, arrival: float, n_compressions: int) -> None:
        self.requests += 1
        self.compressions += n_compressions
        if self.first_arrival is None or arrival < self.first_arrival:
            self.first_arrival = arrival

    def summary(self) -> dict:
        makespan = self.last_finish - self.first_arrival if self.done else 0.0
        if self.weighted_time > 0:
            mean_running = self.weighted_running / self.weighted_time
        else:
            mean_running = self.running_sum / self.steps if self.steps else 0.0
        latency = {}
        for name, values, scale in (("ttft", self.ttfts, 1.0), ("tpot", self.tpots, 1000.0)):
            unit = "s" if name == "ttft" else "ms"
            ordered = sorted(values)
            for percent in (50, 90, 99):
                latency[f"{name}_p{percent}_{unit}"] = scale * percentile(ordered, percent, True)
        tpots, ttfts = len(self.tpots), len(self.ttfts)
        return {
            "requests": self.requests,
            "completed": self.done,
            "failed": self.requests - self.done - self.aborted,
            "aborted": self.aborted,  # their clients went away (a server's Scheduler.abort)
            "output_tokens": self.output_tokens,
            "makespan_s": makespan,
            "tps": self.output_tokens / makespan if makespan > 0 else 0.0,
            # Over the same makespan: finished requests, their prompt tokens (input) and prompt +
            # output tokens (total) per second, as vLLM's benchmark reports them.
            "input_tokens": self.input_tokens,
            "requests_per_s": self.done / makespan if makespan > 0 else 0.0,
            "input_tps": self.input_tokens / makespan if makespan > 0 else 0.0,
            "total_tps": ((self.input_tokens + self.output_tokens) / makespan if makespan > 0
                          else 0.0),
            "mean_tpot_ms": 1000.0 * self.tpot_sum / tpots if tpots else 0.0,
            "mean_ttft_s": self.ttft_sum / ttfts if ttfts else 0.0,
            **latency,
            "peak_running": self.peak_running,
            "mean_running": mean_running,
            "preemptions": self.preemptions,
            "compressions": self.compressions,
            # Prompt tokens computed (recomputation after preemption included) and taken from
            # the prefix cache instead.
            "prefill_tokens": self.prefill_tokens,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            # Of those, the ones found at a request's first admission: what the cache kept
            # across requests (a preempted request's re-admission finds its own blocks again).
            "first_hit_tokens": self.first_hit_tokens,
            # Of those, the host tier's; and the blocks it copied either way (saves + loads).
            "host_hit_tokens": self.host_hit_tokens,
            "host_copy_blocks": self.host_copies,
            "max_blocks_after_compress": self.max_blocks_after_compress,
            # Mean over finished requests whose budget bound them of the KV budget they kept:
            # the configured budget under the fixed policy, more under the elastic one (None: no
            # request's budget bound it).
            "mean_kept_budget": self.kept_sum / self.kept_count if self.kept_count else None,
            "steps": self.busy_steps,
        }


FINISHED, ABORTED = SequenceStatus.FINISHED.value, SequenceStatus.ABORTED.value


def percentile(values: list[float] | array, percent: float, sorted_already: bool = False) -> float:
    """Linear-interpolated percentile (numpy's default), 0.0 for no values."""
    if not values:
        return 0.0
    ordered = values if sorted_already else sorted(values)
    position = (len(ordered) - 1) * percent / 100
    lower = int(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)
