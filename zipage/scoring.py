"""The eviction scoring policies a deployment can choose (`--scoring`), as facts without torch.

A compression keeps, per (layer, KV head), the entries a scoring policy ranks highest
(docs/architecture.md, 'Compression pipeline'). The scorers themselves are torch code in
`kernels/scoring/` (one module per policy); what the layers without torch need of a policy lives
here, declared once: its name for the knob's validation, the per-entry state it keeps (global
scores, which the memory planner counts in every block) and what the analytic cost model charges
for it (`ScoringCost`). `tests/test_scoring.py` checks that both registries name the same policies.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SCORING = "zipage"


@dataclass(frozen=True)
class ScoringCost:
    """What scoring one compression batch costs, in the terms of `sim/analytic.py` (the formulas
    in docs/cost_model.md): the kernels the analytic model prices, no per-policy branches."""

    attention: bool  # the w window queries against every cached key (step 1)
    # The redundancy score's mode ("lightning", "flash", "off"); None: the --redundancy knob's.
    redundancy: str | None
    score_passes: int  # float32 passes over the per-head scores (pooling, window, top-k input)
    launches: int  # kernel launches per launch group besides top-k, redundancy and global score
    key_passes: int = 0  # passes reading every cached key besides attention and redundancy
    value_passes: int = 0  # passes reading every cached value


@dataclass(frozen=True)
class ScoringSpec:
    name: str
    summary: str  # one line, for `--scoring`'s help and the docs' table
    needs_queries: bool  # scores with the window queries (the query slots hold them)
    global_scores: bool  # keeps a global score per entry (with --global-score; the planner counts it)
    cost: ScoringCost


# The pipeline's elementwise passes and launches (sim/analytic.py: SCORE_ELEMENT_PASSES and
# compression_launches_per_group's base), so the default prices exactly as before the registry.
_PIPELINE = dict(score_passes=10, launches=8)

SCORING_SPECS = (
    ScoringSpec("zipage", "the paper's: attention, global score, pooling, redundancy (the knobs)",
                needs_queries=True, global_scores=True,
                cost=ScoringCost(attention=True, redundancy=None, **_PIPELINE)),
    ScoringSpec("snapkv", "SnapKV: window attention, average-pooled (kernel 5)",
                needs_queries=True, global_scores=False,
                cost=ScoringCost(attention=True, redundancy="off", **_PIPELINE)),
    ScoringSpec("rkv", "R-KV: 0.1 x window attention (max-pooled, kernel 7) - 0.9 x all-pairs "
                "redundancy", needs_queries=True, global_scores=False,
                cost=ScoringCost(attention=True, redundancy="flash", **_PIPELINE)),
    ScoringSpec("streaming", "StreamingLLM: the first 4 entries (sinks) and the most recent",
                needs_queries=False, global_scores=False,
                cost=ScoringCost(attention=False, redundancy="off", score_passes=3, launches=4)),
    ScoringSpec("random", "a seeded random choice (deterministic per request and compression)",
                needs_queries=False, global_scores=False,
                cost=ScoringCost(attention=False, redundancy="off", score_passes=4, launches=5)),
    ScoringSpec("keydiff", "KeyDiff: keys least like their head's mean key (no attention)",
                needs_queries=False, global_scores=False,
                cost=ScoringCost(attention=False, redundancy="off", score_passes=4, launches=6,
                                 key_passes=2)),
    ScoringSpec("vnorm", "value norm: the entries whose values have the largest L2 norm",
                needs_queries=False, global_scores=False,
                cost=ScoringCost(attention=False, redundancy="off", score_passes=3, launches=4,
                                 value_passes=1)),
)
SCORING_POLICIES = {spec.name: spec for spec in SCORING_SPECS}


def scoring_spec(name: str) -> ScoringSpec:
    """The policy `name`; a `KeyError` naming the known ones otherwise (ZipageConfig validates
    the knob first, so users see a ConfigError)."""
    try:
        return SCORING_POLICIES[name]
    except KeyError:
        raise KeyError(f"unknown scoring policy {name!r}; known: "
                       f"{', '.join(SCORING_POLICIES)}") from None


def scoring_of(job, default: str) -> str:
    """The policy that scores compression `job`: its request's own (`Sequence.scoring`, a request
    field of zipage/request_fields.py), or `default`, the deployment's, when it brings none."""
    own = getattr(getattr(job, "seq", None), "scoring", None)
    return default if own is None else own


def jobs_by_scoring(jobs, default: str) -> dict[str, list]:
    """`jobs` grouped by the policy that scores each (`scoring_of`), in order of first
    appearance: the engine runs each group as one batch, so a policy's fast path stays batched,
    and the cost models price each group as the engine runs it."""
    groups: dict[str, list] = {}
    for job in jobs:
        groups.setdefault(scoring_of(job, default), []).append(job)
    return groups
