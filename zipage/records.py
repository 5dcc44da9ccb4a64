"""A run's rows: one `StepRecord` per step and one `RequestRecord` per request, the same for the
simulator, the real engine and a served run. Their fields are the columns of a run directory's
steps.csv and requests.csv (`zipage/rundir.py`); the core fills them (`zipage/core/metrics.py`).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields


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
    # KV entries the step's holders share, counted once per holder beyond the first
    # (`StepPlan.shared_kv_tokens`: a fitted decode term; 0 in runs written before it).
    shared_kv_tokens: int = 0
    # Host tier: of `prefix_hit_tokens`, those copied back from host memory, and the blocks the
    # step copied to host and back (`StepPlan.kv_saves`, `kv_loads`: what the copies cost).
    host_hit_tokens: int = 0
    host_saves: int = 0
    host_loads: int = 0
    # Of `prefix_hit_tokens`, those found at a request's first admission (`StepPlan`).
    first_hit_tokens: int = 0
    # Async scheduling (`StepResult`): when the step's plan was made (its t_start for a
    # synchronous step), 1 if it was planned while the step before still ran, 1 if its result
    # was applied after the next step was planned.
    planned_at: float = -1.0
    planned_early: int = 0
    settled_late: int = 0
    # Tokens the step sampled (`StepPlan.sampled`). An engine step that samples none (prompt
    # chunks before their last) returns at its launch, before its forward is done, and the next
    # step that samples waits for it (`unsynced_chunk_steps`). -1: a run written before it.
    n_sampled: int = -1


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
    # (`Compressions.kept_budget`; empty if its budget never bound it).
    kv_budget: int | None = None
    kept_budget: float | None = None
    priority: int = 0  # its class under the priority policy (0 in runs written before it)


STEP_COLUMNS = [f.name for f in fields(StepRecord)]
# Columns added after the first release have defaults: a run directory written before them still
# loads (with those defaults).
STEP_COLUMN_DEFAULTS = {f.name: f.default for f in fields(StepRecord) if f.default is not MISSING}
REQUEST_COLUMNS = [f.name for f in fields(RequestRecord)]
REQUEST_COLUMN_DEFAULTS = {f.name: f.default for f in fields(RequestRecord)
                           if f.default is not MISSING}
