"""StepPlan / StepResult: the only things that cross between the core and a driver.

The scheduler decides everything (who prefills, who decodes, who is compressed into which
blocks, who is preempted) and writes it into a `StepPlan`. A driver — the simulator, the real
engine, the instant test driver — executes the plan and answers with a `StepResult`: how long it
took, which async compression batches completed, which requests stopped early (EOS). Drivers
never make a scheduling or block decision of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zipage.core.sequence import Sequence

PREFILL = "prefill"
DECODE = "decode"
# Chunked prefill: the running requests decode and prompt chunks are computed in one forward
# (decode tokens first in the plan, then the chunks; docs/architecture.md, 'Chunked prefill').
MIXED = "mixed"
IDLE = "idle"  # nothing runnable: the driver waits for the in-flight compression batch


@dataclass(slots=True)
class PrefillItem:
    """One request computed by a prefill (or mixed) step: a whole prompt or one chunk of it.

    Tokens [num_cached_tokens, num_tokens) are computed; the first num_cached_tokens are already
    in the cache (prefix-cache hits, or earlier chunks of the same prompt). For a request that
    was preempted, the request's tokens also cover the outputs it had generated (they are
    recomputed, not regenerated). `samples` is True when the range reaches the request's last
    token: the driver then samples one token for it. A partial chunk computes KV only.
    """

    seq: Sequence
    num_cached_tokens: int
    num_tokens: int
    samples: bool = True
    # The driver computes the logits of every row of the range, not only the sampling one (the
    # request asked for its prompt's log-probabilities: `Sequence.prompt_logits`).
    prompt_logits: bool = False
    # Derived once here (an item is never changed), not per read: the cost model and the step
    # record each read them for every item of every step.
    num_new_tokens: int = field(init=False)
    # (query, key) pairs its causal attention computes: what prefill attention costs.
    attention_pairs: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_new_tokens = self.num_tokens - self.num_cached_tokens
        self.attention_pairs = causal_pairs(self.num_new_tokens, self.num_cached_tokens)


def causal_pairs(new_tokens: int, cached_tokens: int) -> int:
    """Pairs of `new_tokens` queries attending causally over `cached_tokens` earlier keys and
    each other."""
    return new_tokens * cached_tokens + new_tokens * (new_tokens + 1) // 2


@dataclass(slots=True)
class Fork:
    """Another sample of `leader`'s prompt, admitted without a prefill of its own
    (docs/architecture.md, 'Samples of one prompt').

    In the step that computes the leader's last prompt token, `seq` maps the leader's full prompt
    blocks (shared, refcount + 1) and, if the prompt ends inside a block, gets a fresh block that
    the driver fills with a copy of the leader's last block after the forward (`copy`: (source,
    destination)). The driver samples `seq`'s first token from the leader's logits with `seq`'s
    own sampling settings.
    """

    seq: Sequence
    leader: Sequence
    copy: tuple[int, int] | None


@dataclass(slots=True)
class CompressionJob:
    """Compress one request's KV cache into `target_blocks` (docs/architecture.md, 'Rules', rule 5).

    The driver scores the entries in `source_table` (the full final block's window queries live
    in `query_slot`), keeps the top (len(target_blocks) * block_size) per (layer, kv-head) and
    writes them densely, in order, into `target_blocks`. After completion the request's table is
    `kept_blocks + target_blocks + [new_block]`; the scheduler drops `released` when the result
    reports it done.
    """

    seq: Sequence
    source_table: list[int]
    target_blocks: list[int]
    new_block: int
    released: list[int]
    query_slot: int
    is_first: bool  # the request was never compressed before (pooling "first" applies)
    # Its leading blocks the compression leaves in place (its prompt under the "output" scope,
    # docs/architecture.md, 'Compression scope'): the table after is these + targets + new.
    kept_blocks: list[int] = field(default_factory=list)

    @property
    def num_source_blocks(self) -> int:
        return len(self.source_table)


@dataclass(slots=True)
class CompressionBatch:
    """Compressions launched together on the compression stream (async mode)."""

    batch_id: int
    jobs: list[CompressionJob]


@dataclass(slots=True)
class StepPlan:
    step_id: int
    kind: str
    prefill: list[PrefillItem] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    # How many requests decode: len(decode), also when the scheduler does not list them
    # (`Scheduler.decode_lists`); a plan built with its decode list counts it itself.
    num_decode: int = 0
    # Sync compression: run before this step's decode; the compressed requests are in `decode`
    # with their new tables.
    compress_sync: list[CompressionJob] = field(default_factory=list)
    # Async compression: start this batch now; its requests are out of decode until it is done.
    compress_launch: CompressionBatch | None = None
    preempted: list[Sequence] = field(default_factory=list)
    # Samples forked from a leader that samples its first token in this step.
    forks: list[Fork] = field(default_factory=list)
    # Elastic budgets: requests that took a block beyond their N_max instead of compressing.
    grown: list[Sequence] = field(default_factory=list)
    # Sum over decode requests of the KV entries each one attends to this step (its cached
    # entries plus the token being decoded): what a decode step reads from the KV cache.
    decode_context_tokens: int = 0
    # The most KV entries one decode request attends to this step (0: no decode requests).
    decode_max_context: int = 0
    # Prompt tokens the admissions of this step found in the prefix cache (not computed).
    prefix_hit_tokens: int = 0
    # KV entries held by more than one holder, counted once per holder beyond the first: a
    # shared prompt block read by several requests in one step (docs/cost_model.md, 'Decode:
    # shared prefix entries'). Shared blocks are full, so blocks times block size.
    shared_kv_tokens: int = 0
    # Of `prefix_hit_tokens`, those the host tier held (copied back by `kv_loads`).
    host_hit_tokens: int = 0
    # Of `prefix_hit_tokens`, those found at a request's first admission: what the cache kept
    # for it from other requests (its session's history, a shared prompt), not its own blocks
    # found again after a preemption.
    first_hit_tokens: int = 0
    # Host tier (docs/architecture.md, 'Host tier'): copies the driver makes before anything
    # else of the step, saves first: (GPU block, host slot) saves of prompt blocks about to be
    # overwritten, (host slot, GPU block) loads of prefix hits. Empty tuples unless the step
    # has some (a plan is made every step).
    kv_saves: list[tuple[int, int]] | tuple = ()
    kv_loads: list[tuple[int, int]] | tuple = ()
    # Snapshot of the scheduler right after this plan was made (for the metrics records).
    num_running: int = 0
    num_waiting: int = 0
    blocks_used: int = 0
    slots_used: int = 0

    def __post_init__(self) -> None:
        if self.decode:
            self.num_decode = len(self.decode)

    @property
    def sampled(self) -> list[Sequence]:
        """The requests that get a token this step, in the order a driver returns them: the
        prefill items that reach their last token, then the decode requests, then the forks."""
        sampled = [item.seq for item in self.prefill if item.samples] + self.decode
        if self.forks:
            sampled += [fork.seq for fork in self.forks]
        return sampled

    @property
    def block_copies(self) -> list[tuple[int, int]]:
        """(source, destination) blocks the driver copies after the forward (forks)."""
        return [fork.copy for fork in self.forks if fork.copy is not None]

    @property
    def num_prefill_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.prefill)

    @property
    def compressions(self) -> list[CompressionJob]:
        launched = self.compress_launch.jobs if self.compress_launch else []
        return self.compress_sync + launched

    def describe(self) -> str:
        """One line of the decision log: what was decided, in a stable, diff-friendly form."""
        parts = [f"step {self.step_id} {self.kind}"]
        if self.prefill:
            parts.append("prefill=" + ",".join(
                f"{item.seq.seq_id}[{item.num_cached_tokens}:{item.num_tokens}]"
                + ("" if item.samples else "+")  # a partial chunk: more of the prompt follows
                + (f"@q{item.seq.query_slot}" if item.seq.query_slot is not None else "")
                for item in self.prefill))
        if self.decode:
            parts.append("decode=" + ",".join(sorted(str(seq.seq_id) for seq in self.decode)))
        mode = "sync" if self.compress_sync else "launch"
        for job in self.compressions:
            kept = f"{job.kept_blocks}|" if job.kept_blocks else ""  # (its scope keeps them)
            parts.append(f"compress({mode})={job.seq.seq_id}:{kept}{job.source_table}->"
                         f"{job.target_blocks}+{job.new_block}")
        if self.forks:
            parts.append("fork=" + ",".join(
                f"{fork.seq.seq_id}<{fork.leader.seq_id}"
                + (f"({fork.copy[0]}->{fork.copy[1]})" if fork.copy else "")
                for fork in self.forks))
        if self.preempted:
            parts.append("preempt=" + ",".join(str(seq.seq_id) for seq in self.preempted))
        if self.grown:
            parts.append("grow=" + ",".join(str(seq.seq_id) for seq in self.grown))
        if self.kv_saves:
            parts.append("save=" + ",".join(f"{block}->h{slot}" for block, slot in self.kv_saves))
        if self.kv_loads:
            parts.append("load=" + ",".join(f"h{slot}->{block}" for slot, block in self.kv_loads))
        parts.append(f"run={self.num_running} wait={self.num_waiting} "
                     f"blocks={self.blocks_used} slots={self.slots_used}")
        return " ".join(parts)


@dataclass(slots=True)
class StepResult:
    """What a driver reports back after executing a plan."""

    step_id: int
    t_start: float = 0.0
    t_end: float = 0.0
    # Async compression batches that have finished by the end of this step.
    completed_batches: list[int] = field(default_factory=list)
    # Requests that stopped before their max tokens (EOS / stop token). The simulator never
    # sets it: a trace request ends after exactly its output_len tokens.
    stopped: set = field(default_factory=set)
    # Async scheduling: when the plan was made (-1: at t_start, as a synchronous step's is),
    # whether it was made while the step before still ran, and whether this result was applied
    # after the next plan was made (what a step-time replay needs to interleave them the same).
    t_plan: float = -1.0
    planned_early: bool = False
    settled_late: bool = False
