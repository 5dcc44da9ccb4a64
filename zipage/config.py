"""Every scheduling and compression knob, validated, with the paper's defaults.

`ZipageConfig` is what users set (flags of `zipage replay`, keyword arguments of `LLM(...)`). The
capacity the scheduler works with — number of KV blocks and query slots — is not a knob: it comes
from the memory planner (`zipage.core.memory`) or, in tests, is given directly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from zipage.errors import ConfigError
from zipage.scoring import DEFAULT_SCORING, SCORING_POLICIES

POOLING_MODES = ("first", "always", "off")
REDUNDANCY_MODES = ("lightning", "flash", "off")
# How much KV a request keeps (docs/architecture.md, 'Per-request and elastic budgets'): its
# budget, always ("fixed"), or more while free memory allows, never less ("elastic").
BUDGET_POLICIES = ("fixed", "elastic")
# What a compression may evict (docs/architecture.md, 'Compression scope').
COMPRESS_SCOPES = ("all", "output")
# A step's token limit when --max-num-batched-tokens is not given: chunked, a budget that keeps
# decodes smooth (vLLM's online default); whole prompts, one that admits long prompts in one step.
CHUNKED_STEP_TOKENS = 2048
WHOLE_PROMPT_STEP_TOKENS = 16384
# Element type of the K and V cache (docs/architecture.md, 'FP8 KV cache'): "auto" stores K and V
# in the compute dtype; "fp8" in float8 e4m3 with one float32 scale per (entry, KV head), the
# least-error one of a small search around amax / 448 (kernels/kv_quant_ref.py).
KV_CACHE_DTYPES = ("auto", "fp8")
# The waiting queue's order (docs/architecture.md, 'Waiting-queue policies'): arrival ("fcfs"), or
# each request's `priority` class aged by its waiting time ("priority").
SCHEDULING_POLICIES = ("fcfs", "priority")
# A day: longer aging is no aging at all for any trace, and keeps the queue's key finite.
MAX_AGING_S = 86400.0


def knob(default, flag: str, help: str, *, cost: bool = False, choices: tuple | None = None):
    """A `ZipageConfig` field with its command-line flag and help: the one place a knob is
    declared. The CLI (`zipage.cli.flags`), `zipage plan`'s grid axes, the cost models' and
    calibration profiles' knob lists (`cost=True`: the knob changes how long a step takes) and the
    kernels' `CompressionParams` are all derived from these declarations. A boolean knob that is
    on by default gets a `--no-...` flag; one that is off by default a `--knob/--no-knob` pair."""
    return field(default=default, metadata={"flag": flag, "help": help, "cost": cost,
                                            "choices": choices})


@dataclass(frozen=True)
class ZipageConfig:
    block_size: int = knob(256, "--block-size", "tokens per KV block b (a power of two, 16-1024)",
                           cost=True)
    window: int = knob(16, "--window", "observation window w: the last w queries of a block score "
                       "its KV at compression (1 <= w <= b/2)", cost=True)
    kv_budget: int = knob(2048, "--budget", "KV budget k: cached tokens a request keeps after "
                          "compression (a multiple of b); N_max = k/b + 1 blocks", cost=True)
    budget_policy: str = knob("fixed", "--budget-policy", "fixed: every request keeps its "
                              "budget; elastic: a request keeps more while free memory allows and "
                              "is compressed back to its budget as the pool fills",
                              choices=BUDGET_POLICIES)
    compress: bool = knob(True, "--no-compress", "Full KV: plain PagedAttention, the baseline")
    hybrid: bool = knob(True, "--no-hybrid", "constrained scheduling: every running request holds "
                        "a query slot (default: hybrid)")
    prefix_cache: bool = knob(True, "--no-prefix-cache", "do not share prompt blocks between "
                              "requests")
    compress_scope: str = knob("all", "--compress-scope", "what a compression may evict: all "
                               "(prompt and output) or output (the prompt is kept whole, for the "
                               "next turn's prefix cache; a request holds its prompt plus its "
                               "budget)", choices=COMPRESS_SCOPES)
    query_slots: int | None = knob(None, "--query-slots", "most query slots: requests that may "
                                   "write window queries at once (default: as many as the memory "
                                   "backs at the budget, the paper's maximum concurrency); the "
                                   "memory of fewer goes to KV blocks. For sessions under "
                                   "--compress-scope output, where few requests outgrow their budget")
    scheduling_policy: str = knob("fcfs", "--scheduling-policy", "order of the waiting queue: "
                                  "fcfs (arrival), or priority (each request's priority class, "
                                  "lower first, aged so nothing starves; victims are chosen "
                                  "lowest class first)", choices=SCHEDULING_POLICIES)
    priority_aging_s: float = knob(10.0, "--priority-aging-s", "under --scheduling-policy "
                                   "priority: seconds of waiting worth one priority class (a "
                                   "request is never passed by one that arrived more than "
                                   "(its class - the other's) x this later)")
    async_compress: bool = knob(True, "--no-async", "compress synchronously, before the step's "
                                "decode (default: on a side stream, overlapping decode)")
    async_scheduling: bool = knob(False, "--async-scheduling", "plan each step while the "
                                  "previous one runs on the GPU; an end-of-sequence stop then "
                                  "applies one step later (docs/architecture.md, 'Async "
                                  "scheduling')", cost=True)
    global_score: bool = knob(True, "--no-global-score", "score with this compression's "
                              "attention only, without the decayed score of earlier ones",
                              cost=True)
    alpha: float = knob(0.8, "--alpha", "decay of the global score (0-1)")
    pooling: str = knob("first", "--pooling", "max-pool the scores at the first compression "
                        "only, always, or off", choices=POOLING_MODES)
    redundancy: str = knob("lightning", "--redundancy", "redundancy score: lightning (causal, "
                           "cheap), flash (all pairs) or off", cost=True, choices=REDUNDANCY_MODES)
    lambda_weight: float = knob(0.2, "--lambda", "final score = lambda * attention - "
                                "(1 - lambda) * redundancy (0-1)")
    tau: float = knob(0.4, "--tau", "softmax temperature of the redundancy score (> 0)")
    similarity_threshold: float = knob(0.5, "--similarity-threshold", "keys above this cosine "
                                       "similarity count as near-duplicates (-1 to 1)")
    # Which entries a compression keeps (zipage/scoring.py, kernels/scoring/): the knobs from
    # --no-global-score to --similarity-threshold shape the default pipeline only.
    scoring: str = knob(DEFAULT_SCORING, "--scoring", "eviction scoring policy: "
                        + "; ".join(f"{name}: {spec.summary}"
                                    for name, spec in SCORING_POLICIES.items()),
                        cost=True, choices=tuple(SCORING_POLICIES))
    layer_stride: int = knob(8, "--layer-stride", "layers compressed per launch (cross-layer "
                             "parallel compression)", cost=True)
    max_num_seqs: int = knob(512, "--max-num-seqs", "most requests running at once")
    max_num_batched_tokens: int | None = knob(None, "--max-num-batched-tokens", "most tokens "
                                              "computed in one step: with chunked prefill the "
                                              "decode tokens plus prompt chunks (default "
                                              f"{CHUNKED_STEP_TOKENS}), without it the prompt "
                                              "tokens of a prefill step (default "
                                              f"{WHOLE_PROMPT_STEP_TOKENS})")
    # On by default, as vLLM's: on production shapes it costs at most 2 % of throughput and cuts
    # the TPOT tail up to 13x (docs/BENCHMARKS.md, 'Defaults on real shapes').
    chunked_prefill: bool = knob(True, "--chunked-prefill", "split prompts into chunks that "
                                 "share a step with the running requests' decodes (decode "
                                 "first, chunks fill the rest of --max-num-batched-tokens)")
    # Scratch memory and latency of one async batch grow with its source blocks.
    max_compress_batch_blocks: int = knob(4096, "--max-compress-batch-blocks", "most source "
                                          "blocks in one compression batch")
    kv_cache_dtype: str = knob("auto", "--kv-cache-dtype", "K/V cache element type: auto (the "
                               "compute dtype) or fp8 (float8 e4m3 with a float32 scale per "
                               "entry and KV head, the least-error of 8 candidates around "
                               "amax/448: ~2x the blocks; weights, activations, window "
                               "queries and scores stay in the compute dtype)", cost=True,
                               choices=KV_CACHE_DTYPES)
    max_model_len: int | None = knob(None, "--max-model-len", "longest prompt + output of a "
                                     "request (default: the model's context length)")

    def __post_init__(self) -> None:
        self.validate()

    @property
    def step_tokens(self) -> int:
        """Most tokens one step computes: `max_num_batched_tokens`, or its default for the
        prefill mode (resolved here, not stored, so `replace(config, chunked_prefill=False)`
        gets the whole-prompt default rather than the chunked one)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return CHUNKED_STEP_TOKENS if self.chunked_prefill else WHOLE_PROMPT_STEP_TOKENS

    @property
    def n_max(self) -> int:
        """Most blocks a request holds while decoding: the budget plus one block for new tokens."""
        return self.kv_budget // self.block_size + 1

    @property
    def keeps_global_scores(self) -> bool:
        """Whether compressions keep a global score per entry: the score cache the memory
        planner counts in every block and the engine allocates."""
        return (self.compress and self.global_score
                and SCORING_POLICIES[self.scoring].global_scores)

    def validate(self) -> None:
        b = self.block_size
        if not isinstance(b, int) or b < 16 or b > 1024 or b & (b - 1):
            _bad("block_size", b, "a power of two between 16 and 1024 (e.g. --block-size 256)")
        # The window only exists for compression; Full KV may use blocks smaller than 2 * window.
        if self.compress and (expected := window_violation(b, self.window)):
            _bad("window", self.window, expected)
        if expected := budget_violation(b, self.kv_budget):
            _bad("kv_budget", self.kv_budget, f"{expected} (e.g. --budget {max(b, 2048 // b * b)})")
        if self.budget_policy not in BUDGET_POLICIES:
            _bad("budget_policy", self.budget_policy, f"one of {', '.join(BUDGET_POLICIES)}")
        if self.compress_scope not in COMPRESS_SCOPES:
            _bad("compress_scope", self.compress_scope, f"one of {', '.join(COMPRESS_SCOPES)}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            _bad("scheduling_policy", self.scheduling_policy,
                 f"one of {', '.join(SCHEDULING_POLICIES)}")
        if not (isinstance(self.priority_aging_s, (int, float)) and 0 < self.priority_aging_s
                <= MAX_AGING_S):
            _bad("priority_aging_s", self.priority_aging_s,
                 f"a number of seconds in (0, {MAX_AGING_S:g}]")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            _bad("kv_cache_dtype", self.kv_cache_dtype, f"one of {', '.join(KV_CACHE_DTYPES)}")
        if self.pooling not in POOLING_MODES:
            _bad("pooling", self.pooling, f"one of {', '.join(POOLING_MODES)}")
        if self.redundancy not in REDUNDANCY_MODES:
            _bad("redundancy", self.redundancy, f"one of {', '.join(REDUNDANCY_MODES)}")
        if self.scoring not in SCORING_POLICIES:
            _bad("scoring", self.scoring, f"one of {', '.join(SCORING_POLICIES)}")
        if self.scoring != DEFAULT_SCORING:
            # Another policy fixes its own constants; a pipeline knob set beside it would be
            # ignored without a word.
            for name in PIPELINE_KNOBS:
                if getattr(self, name) != _DEFAULTS[name]:
                    raise ConfigError(f"{name}: shapes the {DEFAULT_SCORING} scoring policy only, "
                                      f"but scoring is {self.scoring!r}; drop it, or use "
                                      f"--scoring {DEFAULT_SCORING}")
        for name in ("alpha", "lambda_weight"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                _bad(name, value, "a number between 0 and 1")
        if not self.tau > 0:
            _bad("tau", self.tau, "a positive number")
        if not -1.0 <= self.similarity_threshold <= 1.0:
            _bad("similarity_threshold", self.similarity_threshold, "a cosine similarity in [-1, 1]")
        given = [name for name in ("layer_stride", "max_num_seqs", "max_num_batched_tokens",
                                   "max_compress_batch_blocks", "query_slots")
                 if getattr(self, name) is not None]
        for name in given:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                _bad(name, value, "a positive integer")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            _bad("max_model_len", self.max_model_len, "an integer >= 2, or None for no limit")

    @classmethod
    def knobs(cls) -> list:
        """The declared knobs (dataclass fields with their flag, help and cost metadata)."""
        return list(fields(cls))

    def cost_knobs(self) -> dict:
        """The knobs that change how long a step takes: what a cost model or a calibration
        profile must hold for."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata["cost"]}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "ZipageConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown config field(s) {', '.join(unknown)}; known: "
                              f"{', '.join(sorted(known))}")
        return cls(**values)


# The knobs of the default scoring pipeline, which other scoring policies do not read.
PIPELINE_KNOBS = ("global_score", "alpha", "pooling", "redundancy", "lambda_weight", "tau",
                  "similarity_threshold")
_DEFAULTS = {f.name: f.default for f in fields(ZipageConfig)}


def window_violation(block_size: int, window) -> str | None:
    """What a valid window is, if `window` is not one, else None: it lies in the second half of
    a block (b >= 2w), the part of the final block the scheduler and the kernels assume holds the
    window queries. The config and the compression kernels' parameters both check it."""
    if isinstance(window, int) and 1 <= window and 2 * window <= block_size:
        return None
    return f"an integer with 1 <= window <= block_size/2 = {block_size // 2}"


def budget_violation(block_size: int, budget) -> str | None:
    """What a valid KV budget is, if `budget` is not one, else None: a positive multiple of the
    block size, so a request keeps whole blocks and holds N_max = budget / b + 1 >= 2 of them. The
    `--budget` default and every request's own budget (a trace's, `SamplingParams`', a served
    request's `kv_budget`) are checked by this one rule."""
    if isinstance(budget, int) and not isinstance(budget, bool) and budget >= block_size \
            and budget % block_size == 0:
        return None
    return f"a positive multiple of block_size {block_size}"


def _bad(field_name: str, value, expected: str) -> None:
    raise ConfigError(f"{field_name}: got {value!r}, expected {expected}")
