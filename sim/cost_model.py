"""Step durations for the simulator: the cost-model interface and the loader that picks one.

The simulator asks a `CostModel` (docs/architecture.md, 'Simulator') for `step_time(plan)` — a
step of any kind: its sync compressions, then one forward over its decode requests and prompt
chunks (a prefill, decode or mixed step) — for `compress_time(batch)` of an async batch, and for
`decode_contention(overlap_fraction)`. A forward is costed from its `StepWork` (the counts of what
it computes), so one formula covers every kind of step. Two implementations answer: the roofline
`AnalyticCostModel` (sim/analytic.py) and the `CalibratedCostModel` fitted to a measured profile
(sim/calibrated.py). `load_cost_model` picks one from a command-line spec. Every formula,
constant and assumption is written out in docs/cost_model.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

from zipage.core.step import causal_pairs
from zipage.decode_grid import PROGRAMS_PER_SM
from zipage.scoring import DEFAULT_SCORING, jobs_by_scoring

if TYPE_CHECKING:
    from zipage.core.step import CompressionBatch, CompressionJob, StepPlan
    from zipage.profile import Validation

PROFILES_DIR = Path(__file__).parent / "profiles"
ANALYTIC = "analytic"


@dataclass(slots=True)  # not frozen: a frozen dataclass takes twice as long to build
class StepWork:
    """What one step's forward computes, in the counts the cost models read.

    A decode step has only decode requests, a prefill step only prompt chunks (whole prompts or
    parts of them), a mixed step (chunked prefill) both; an idle step nothing.
    """

    num_decode: int = 0  # requests decoding one token each
    decode_context_tokens: int = 0  # KV entries they attend to in all, their new tokens included
    num_prefill: int = 0  # prompt chunks
    num_sampled_prefill: int = 0  # chunks that reach their prompt's end: each samples a token
    prefill_tokens: int = 0  # tokens the chunks compute
    cached_tokens: int = 0  # KV entries before the chunks: prefix-cache hits, earlier chunks
    attention_pairs: int = 0  # (query, key) pairs of the chunks' causal attention
    # The most KV entries one decode request attends to (0: not known, priced as if balanced).
    decode_max_context: int = 0
    # KV entries held by more than one holder, once per holder beyond the first.
    shared_kv_tokens: int = 0

    @classmethod
    def of(cls, plan: StepPlan) -> "StepWork":
        return cls(*cls.counts(plan))

    @staticmethod
    def counts(plan: StepPlan) -> tuple[int, int, int, int, int, int, int, int, int]:
        """The fields of `of(plan)`, in order (what `CostModel.forward_time` takes)."""
        if not plan.prefill:
            return (plan.num_decode, plan.decode_context_tokens, 0, 0, 0, 0, 0,
                    plan.decode_max_context, plan.shared_kv_tokens)
        sampled = new_tokens = cached_tokens = pairs = 0
        for item in plan.prefill:  # one pass, not four generators: a mixed step is common
            sampled += item.samples
            new_tokens += item.num_new_tokens
            cached_tokens += item.num_cached_tokens
            pairs += item.attention_pairs
        return (plan.num_decode, plan.decode_context_tokens, len(plan.prefill), sampled,
                new_tokens, cached_tokens, pairs, plan.decode_max_context, plan.shared_kv_tokens)

    @classmethod
    def from_counts(cls, num_decode: int = 0, decode_context_tokens: int = 0,
                    prefill: Sequence[tuple[int, int]] = ()) -> "StepWork":
        """`prefill`: (new_tokens, cached_tokens) of each chunk; every chunk ends its prompt."""
        return cls(num_decode, decode_context_tokens, len(prefill), len(prefill),
                   sum(new for new, _ in prefill), sum(cached for _, cached in prefill),
                   sum(causal_pairs(new, cached) for new, cached in prefill))


class CostModel(ABC):
    """Durations in seconds of the steps a `StepPlan` describes.

    Subclasses cost a forward from its `StepWork` and a compression batch from its source blocks;
    the plan-level methods here extract those counts, so the engine's calibration tool and tests
    can ask without building plans.
    """

    # Multiplier of a step fully overlapped by an async compression batch.
    contention_factor: float
    # Which engine steps replayed CUDA graphs when the costs were measured ({"decode": bool,
    # "prefill": bool}), where a profile says so; None for the analytic model.
    measured_graphs: dict[str, bool] | None = None
    # The token buckets the measured engine padded prefill and mixed steps to (none: unpadded).
    prefill_buckets: tuple[int, ...] = ()
    # The batch sizes the measured engine captured decode graphs at (none: priced at the batch).
    decode_graph_sizes: tuple[int, ...] = ()
    # The decode programs an SM the priced engine's split-K grid aimed for (zipage/decode_grid.py).
    decode_programs_per_sm: int = PROGRAMS_PER_SM
    # How the priced engine split a decode step's rows (zipage/profile.py DECODE_SPLIT_MODES): the
    # analytic model follows today's engine ("rule"); a profile, the engine it measured.
    decode_split: str = "rule"
    # How far to trust what the model predicts: a profile's record of its errors on a held-out
    # workload (zipage/profile.py). None for the analytic model and an unvalidated profile.
    validation: Validation | None = None
    # The deployment's scoring policy (--scoring): what a compression of a request without a
    # policy of its own (`Sequence.scoring`) is priced with.
    scoring: str = DEFAULT_SCORING
    # Seconds to copy one KV block between the GPU and host memory (the host tier's saves and
    # loads, docs/cost_model.md, 'Host tier'): the deployment's block bytes over the GPU's host
    # link (`price_host_copies`); 0 without a host tier.
    host_block_s: float = 0.0

    def price_host_copies(self, block_bytes: int, link_bytes_per_s: float) -> None:
        """Price the host tier's copies: a deployment with one sets its block size and link."""
        self.host_block_s = block_bytes / link_bytes_per_s

    def step_time(self, plan: StepPlan) -> float:
        """A step of any kind: its sync compressions run first, then one forward over its decode
        requests and prompt chunks. An idle step computes nothing (0)."""
        # Priced from its counts, no StepWork built: the simulator prices every step here.
        if plan.prefill:
            duration = self.forward_time(*StepWork.counts(plan))
        else:  # a decode step (most steps): its counts are the plan's own
            duration = self.forward_time(plan.num_decode, plan.decode_context_tokens, 0, 0, 0, 0,
                                         0, plan.decode_max_context, plan.shared_kv_tokens)
        if plan.compress_sync:
            duration += self.compress_time(plan.compress_sync)
        if plan.kv_saves or plan.kv_loads:  # copied before the forward, on its stream
            duration += (len(plan.kv_saves) + len(plan.kv_loads)) * self.host_block_s
        return duration

    def compress_time(self, jobs: Iterable[CompressionJob] | CompressionBatch) -> float:
        """Duration of one compression batch (the jobs of a plan, or a `CompressionBatch`), each
        job priced by its own size: the blocks it reads and the blocks it keeps (a request's own
        budget, or its elastic cap). The engine runs the jobs of each scoring policy as a batch
        of their own, one after the other, so each group is priced with its policy and the
        durations add up."""
        jobs = getattr(jobs, "jobs", jobs)
        return sum((self.compress_time_for([job.num_source_blocks for job in group],
                                           [len(job.target_blocks) for job in group], scoring)
                    for scoring, group in jobs_by_scoring(jobs, self.scoring).items()), 0.0)

    def decode_contention(self, overlap_fraction: float) -> float:
        """Multiplier of a step whose `overlap_fraction` (0..1) ran beside a compression."""
        overlap = min(1.0, max(0.0, overlap_fraction))
        return 1.0 + (self.contention_factor - 1.0) * overlap

    def decode_time_for(self, batch: int, context_tokens: int, max_context: int = 0) -> float:
        """A decode step of `batch` requests attending to `context_tokens` KV entries in total,
        the longest `max_context` of them (0: not known)."""
        return self.forward_time_for(StepWork(batch, context_tokens,
                                              decode_max_context=max_context))

    def prefill_time_for(self, requests: Sequence[tuple[int, int]]) -> float:
        """A prefill step over (new_tokens, cached_tokens) per request."""
        return self.forward_time_for(StepWork.from_counts(prefill=requests))

    @abstractmethod
    def forward_time_for(self, work: StepWork) -> float:
        """One forward over `work`: a decode, prefill or mixed step without its compressions."""

    def forward_time(self, num_decode: int, decode_context_tokens: int, num_prefill: int,
                     num_sampled_prefill: int, prefill_tokens: int, cached_tokens: int,
                     attention_pairs: int, decode_max_context: int,
                     shared_kv_tokens: int) -> float:
        """`forward_time_for` of the `StepWork` of these counts (its fields, in its order): a
        model may answer from them without the `StepWork` built."""
        return self.forward_time_for(StepWork(
            num_decode, decode_context_tokens, num_prefill, num_sampled_prefill, prefill_tokens,
            cached_tokens, attention_pairs, decode_max_context, shared_kv_tokens))

    @abstractmethod
    def compress_time_for(self, blocks: Sequence[int], kept_blocks: Sequence[int] | None = None,
                          scoring: str | None = None) -> float:
        """A compression batch of requests holding `blocks[i]` source blocks each and keeping
        `kept_blocks[i]` (None: the configured budget, N_max - 1 blocks, each), all scored by
        the policy `scoring` (None: the deployment's, `self.scoring`)."""
