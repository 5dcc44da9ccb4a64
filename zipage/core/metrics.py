"""Per-step and per-request records, one schema for the simulator and the real engine.

Every driver calls `MetricsRecorder.record_step(plan, result)` after `Scheduler.finish`, and
`request_records(scheduler)` at the end. `summarize` turns both into the summary every report
prints (docs/architecture.md, 'Traces and metrics'): TPS = output tokens / (last finish - first
arrival); TPOT of a request = (finish - first token) / (output_len - 1).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields

from zipage.core.sequence import Sequence, SequenceStatus
from zipage.core.step import StepPlan, StepResult


# Slots: a day of traffic keeps millions of these.
@dataclass(slots=True)
class StepRecord:
    step_id: int
    t_start: float
    t_end: float
    kind: str
    n_prefill: int
    n_decode: int
    n_compress: int
    n_running: int
    n_waiting: int
    blocks_used: int
    blocks_total: int
    slots_used: int
    preempted: int
    prefill_tokens: int
    decode_context_tokens: int
    # Async compression batches this step's result reported done (what a step-time replay
    # needs to complete them in the same step).
    batches_done: int = 0
    # Cost features a profile can be fitted from (`zipage calibrate --from-run`): the prefill's
    # causal attention pairs and the source blocks of the compressions planned in this step.
    attention_pairs: int = 0
    compress_blocks: int = 0
    # Prompt tokens this step's admissions took from the prefix cache instead of computing.
    prefix_hit_tokens: int = 0
    # The longest KV context among this step's decode requests: a decode step's time follows it
    # as well as the sum (a fitted decode term; 0 in runs written before it).
    decode_max_context: int = 0


@dataclass(slots=True)
class RequestRecord:
    id: str
    arrival: float
    first_token: float | None
    finish: float | None
    prompt_len: int
    output_len: int
    n_preempted: int
    n_compressions: int
    max_blocks_held_after_first_compression: int
    status: str
    error: str | None
    # The request's KV budget (its own or the default) and the budget it actually kept
    # (`Scheduler._kept_budget`; empty if its budget never bound it).
    kv_budget: int | None = None
    kept_budget: float | None = None


STEP_COLUMNS = [f.name for f in fields(StepRecord)]
# Columns added after the first release have defaults: a run directory written before them still
# loads (with those defaults).
STEP_COLUMN_DEFAULTS = {f.name: f.default for f in fields(StepRecord) if f.default is not MISSING}
REQUEST_COLUMNS = [f.name for f in fields(RequestRecord)]
REQUEST_COLUMN_DEFAULTS = {f.name: f.default for f in fields(RequestRecord)
                           if f.default is not MISSING}


class MetricsRecorder:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.steps: list[StepRecord] = []

    def record_step(self, plan: StepPlan, result: StepResult) -> None:
        self.steps.append(StepRecord(
            step_id=plan.step_id, t_start=result.t_start, t_end=result.t_end, kind=plan.kind,
            n_prefill=len(plan.prefill), n_decode=len(plan.decode),
            n_compress=len(plan.compress_sync) + (
                len(plan.compress_launch.jobs) if plan.compress_launch else 0),
            n_running=plan.num_running, n_waiting=plan.num_waiting,
            blocks_used=plan.blocks_used, blocks_total=self.num_blocks,
            slots_used=plan.slots_used, preempted=len(plan.preempted),
            prefill_tokens=plan.num_prefill_tokens,
            decode_context_tokens=plan.decode_context_tokens,
            batches_done=len(result.completed_batches),
            attention_pairs=sum(item.attention_pairs for item in plan.prefill),
            compress_blocks=sum(job.num_source_blocks for job in plan.compressions),
            prefix_hit_tokens=plan.prefix_hit_tokens,
            decode_max_context=plan.decode_max_context,
        ))


def request_record(seq: Sequence) -> RequestRecord:
    return RequestRecord(
        id=str(seq.seq_id), arrival=seq.arrival_s, first_token=seq.first_token_time,
        finish=seq.finish_time, prompt_len=seq.prompt_len,
        # A rejected request never ran: its row keeps the output length it asked for.
        output_len=seq.max_output_tokens if seq.error is not None else seq.num_output_tokens,
        n_preempted=seq.num_preemptions,
        n_compressions=seq.num_compressions,
        max_blocks_held_after_first_compression=seq.max_blocks_after_first_compression,
        status=seq.status.value, error=seq.error,
        kv_budget=seq.kv_budget,
        kept_budget=seq.kept_budget,
    )


def request_records(sequences: list[Sequence]) -> list[RequestRecord]:
    return [request_record(seq) for seq in sequences]


def summarize(steps: list[StepRecord], requests: list[RequestRecord]) -> dict:
    """The run's headline numbers (keys shared by every driver's `--json`)."""
    done = [r for r in requests if r.status == SequenceStatus.FINISHED.value]
    aborted = [r for r in requests if r.status == SequenceStatus.ABORTED.value]
    output_tokens = sum(r.output_len for r in done)
    if done:
        start = min(r.arrival for r in requests)
        makespan = max(r.finish for r in done) - start
    else:
        makespan = 0.0
    tpots = [(r.finish - r.first_token) / (r.output_len - 1) for r in done if r.output_len > 1]
    busy = [s for s in steps if s.kind != "idle"]
    weighted_time = sum(s.t_end - s.t_start for s in steps)
    if weighted_time > 0:
        mean_running = sum(s.n_running * (s.t_end - s.t_start) for s in steps) / weighted_time
    else:
        mean_running = sum(s.n_running for s in steps) / len(steps) if steps else 0.0
    compressed = [r.max_blocks_held_after_first_compression for r in done if r.n_compressions]
    kept = [r.kept_budget for r in done if r.kept_budget is not None]
    ttfts = [r.first_token - r.arrival for r in done]
    latency = {}
    for name, values, scale in (("ttft", ttfts, 1.0), ("tpot", tpots, 1000.0)):
        unit = "s" if name == "ttft" else "ms"
        for percent in (50, 90, 99):
            latency[f"{name}_p{percent}_{unit}"] = scale * percentile(values, percent)
    return {
        "requests": len(requests),
        "completed": len(done),
        "failed": len(requests) - len(done) - len(aborted),
        "aborted": len(aborted),  # their clients went away (a server's Scheduler.abort)
        "output_tokens": output_tokens,
        "makespan_s": makespan,
        "tps": output_tokens / makespan if makespan > 0 else 0.0,
        "mean_tpot_ms": 1000.0 * sum(tpots) / len(tpots) if tpots else 0.0,
        "mean_ttft_s": sum(ttfts) / len(ttfts) if ttfts else 0.0,
        **latency,
        "peak_running": max((s.n_running for s in steps), default=0),
        "mean_running": mean_running,
        "preemptions": sum(s.preempted for s in steps),
        "compressions": sum(r.n_compressions for r in requests),
        # Prompt tokens computed (recomputation after preemption included) and taken from the
        # prefix cache instead.
        "prefill_tokens": sum(s.prefill_tokens for s in steps),
        "prefix_hit_tokens": sum(s.prefix_hit_tokens for s in steps),
        "max_blocks_after_compress": max(compressed, default=0),
        # Mean over finished requests whose budget bound them of the KV budget they kept: the
        # configured budget under the fixed policy, more under the elastic one (None: no
        # request's budget bound it).
        "mean_kept_budget": sum(kept) / len(kept) if kept else None,
        "steps": len(busy),
    }


def percentile(values: list[float], percent: float) -> float:
    """Linear-interpolated percentile (numpy's default), 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    position = (len(ordered) - 1) * percent / 100
    lower = int(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)
