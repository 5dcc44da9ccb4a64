"""How much each scoring policy costs in quality against Full KV on a real model (`zipage quality`).

Two measurements, every policy of the registry (`zipage/scoring.py`) at every budget, all through
the real engine: paged KV, the scheduler's compressions, each policy's own scorer
(docs/compression.md, 'Scoring policies'):

1. **Teacher-forced agreement and KL.** Full KV (compression off) writes a greedy continuation of
   each prompt and its next-token distributions. Each policy x budget then decodes the same
   prompts *forced* along that continuation: the step loop's `next_token` hook replaces every
   sampled token with the reference one (`analysis/fidelity.py`, `force_reference`), so every
   position is scored on the same history. At each position: does the compressed model's argmax
   equal the reference token, and KL(Full KV || compressed) over the whole vocabulary (the
   runner's full logits, not top-k log-probabilities: the KL is exact).
2. **Needle retrieval.** A pass key stated at the start of a long prompt (haystack: the prose of
   `haystack.txt`, which ships beside this module), asked for at the end; greedy answer; a hit
   when the first number of the answer is the key. An eviction that drops the key fails visibly.

Every prompt is exactly `prompt_tokens` long, a multiple of the block size, so its last block is
full after the prefill and the first decode step compresses it (rule 2, docs/architecture.md):
output 0 comes from the prefill (the whole prompt, for every policy), every later output from a
compressed cache. Means are over outputs 1 on, up to the reference's first end-of-sequence. The
needle prompt stops one token short of its answer prefix ("The pass key is"), whose last token is
forced at output 0, so every digit of the answer is predicted after the first compression.

All policy x budget requests of a run decode side by side in one engine (`VariantDispatcher`
sends each request's compression to its policy; budgets are per request), and the prompt's
blocks are computed once and shared through the prefix cache: on a CPU that is what makes 21
variants affordable. Compression is synchronous, so the step a cache changes is exact.
"""

from __future__ import annotations

import csv
import json
import math
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from zipage.analysis.fidelity import (
    Reference,
    Variant,
    VariantDispatcher,
    force_reference,
    generate_reference,
    run_requests,
)
from zipage.analysis.quality_settings import QualitySettings
from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings, effective_config, plan_capacity
from zipage.core.memory import block_bytes, query_slot_bytes
from zipage.core.sampling import SamplingParams
from zipage.engine.builder import Engine
from zipage.engine.runner import ModelRunner
from zipage.errors import ConfigError

HAYSTACK = Path(__file__).with_name("haystack.txt")
FULL_KV = "Full KV"
GIB = 1024**3
# Agreement prompts: a description to retell, so the continuation draws on the whole prompt.
RETELL_HEAD = "Read this description of a river town carefully.\n\n"
RETELL_TAIL = ("\n\nNow retell the description above in your own words, place by place, "
               "mentioning every person, building and custom it names.")
NEEDLE_HEAD = ("Below is a long text. Its first line holds a pass key: remember it, you will be "
               "asked for it at the end.\n\nThe pass key is {key}. Remember it: {key} is the pass "
               "key.\n\n")
NEEDLE_TAIL = "\n\nWhat is the pass key given at the start of the text? Answer with the number."
ANSWER_PREFIX = "The pass key is"
# The engine runs of a study (`run_names`), as a progress bar names them.
FULL_KV_REFERENCE, FULL_KV_FORCED, FULL_KV_NEEDLE = ("Full KV reference", "Full KV forced",
                                                     "Full KV needle")
POLICIES_FORCED, POLICIES_NEEDLE = "policies forced", "policies needle"


@dataclass
class QualityRow:
    """One line of the table: a policy at a budget (or Full KV, budget None)."""

    policy: str
    budget: int | None
    agreement: float  # share of measured positions whose argmax is the reference token
    kl: float  # mean KL(Full KV || this) in nats over them
    positions: int  # positions measured
    needle_hits: int
    needles: int
    compressions: int  # over this row's forced and needle requests
    needle_texts: list[str] = field(default_factory=list)

    @property
    def needle_rate(self) -> float:
        return self.needle_hits / self.needles if self.needles else math.nan


@dataclass
class QualityResult:
    settings: QualitySettings
    rows: list[QualityRow]  # Full KV first, then by budget, policies in the order given
    reference_eos: list[int | None]  # output index of each reference's first end-of-sequence
    needle_keys: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- prompts

def paragraphs() -> list[str]:
    """The haystack's paragraphs (plain prose, no numbers that could pass for a key)."""
    return [part.strip() for part in HAYSTACK.read_text().split("\n\n") if part.strip()]


def fitted_prompt(tokenizer, head: str, tail: str, first_paragraph: int, length: int,
                  answer: Sequence[int] = ()) -> list[int]:
    """Exactly `length` token ids: the chat template around `head` + haystack + `tail`, ready
    for the assistant's turn, then `answer`; the haystack (paragraphs from `first_paragraph`
    on, wrapping) is cut to fit. Pieces are encoded apart, so the cut is exact."""
    marker = "\u0000HAYSTACK\u0000"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": head + marker + tail}],
                                             tokenize=False, add_generation_prompt=True)
    before, after = rendered.split(marker)
    start = tokenizer.encode(before, add_special_tokens=False)
    end = tokenizer.encode(after, add_special_tokens=False) + list(answer)
    room = length - len(start) - len(end)
    if room < 16:
        raise ConfigError(f"--prompt-tokens: {length} leaves no room for the haystack")
    texts = paragraphs()
    filler: list[int] = []
    index = first_paragraph
    while len(filler) < room:
        filler += tokenizer.encode(texts[index % len(texts)] + "\n\n", add_special_tokens=False)
        index += 1
    return start + filler[:room] + end


def retell_prompts(tokenizer, settings: QualitySettings) -> list[list[int]]:
    """The agreement prompts, each starting its haystack at another paragraph."""
    step = max(1, len(paragraphs()) // max(1, settings.prompts))
    return [fitted_prompt(tokenizer, RETELL_HEAD, RETELL_TAIL, index * step,
                          settings.prompt_tokens) for index in range(settings.prompts)]


@dataclass(frozen=True)
class Needle:
    key: str
    prompt: list[int]  # ends one token short of the answer prefix
    forced: list[int]  # that last token, output 0


def needle_cases(tokenizer, settings: QualitySettings) -> list[Needle]:
    """Pass keys drawn from the seed, each in its own haystack (another first paragraph)."""
    draw = random.Random(settings.seed)
    prefix = tokenizer.encode(ANSWER_PREFIX, add_special_tokens=False)
    cases = []
    for index in range(settings.needles):
        key = str(draw.randrange(10_000, 100_000))
        prompt = fitted_prompt(tokenizer, NEEDLE_HEAD.format(key=key), NEEDLE_TAIL, index,
                               settings.prompt_tokens, prefix[:-1])
        cases.append(Needle(key, prompt, prefix[-1:]))
    return cases


def needle_hit(answer: str, key: str) -> bool:
    """The first number of the answer is the key (a longer or shorter number is a miss)."""
    found = re.search(r"\d+", answer)
    return found is not None and found.group() == key


# --------------------------------------------------------------------------- engines

def build_engine(model: torch.nn.Module, shape, tokenizer, spec: str, config: ZipageConfig,
                 blocks: int, slots: int) -> Engine:
    """A float32 engine on the loaded model's device with exactly `blocks` KV blocks and `slots`
    query slots (the caller counts what its runs hold at most, so nothing is ever preempted: a
    preempted request would recompute and compress at other points; `run_requests` checks)."""
    device = next(model.parameters()).device
    element = 4  # float32 bytes
    memory = blocks * block_bytes(shape, config, element)
    if config.compress:
        config = ZipageConfig(**{**config.to_dict(), "query_slots": slots})
        memory += slots * query_slot_bytes(shape, config, element)
    settings = ReplaySettings(model=spec, dtype="float32", kv_memory_gb=memory / GIB,
                              config=config)
    config = effective_config(settings, shape)
    capacity = plan_capacity(settings, shape, None)
    runner = ModelRunner(model, shape, config, capacity, torch.float32, device, cuda_graphs=False)
    return Engine(model, shape, tokenizer, config, capacity, runner, device)


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


# --------------------------------------------------------------------------- the study

def variants_of(settings: QualitySettings, config: ZipageConfig) -> list[tuple[str, int, Variant]]:
    """(policy, budget, its Variant) for every policy x budget, by budget. `zipage` runs the
    pipeline with the engine's knobs; the others their own scorer (`BaselineEviction`)."""
    out = []
    for budget in settings.budgets:
        for policy in settings.policies:
            name = f"{policy}@{budget}"
            variant = (Variant(name, global_score=config.global_score,
                               redundancy=config.redundancy, pooling=config.pooling,
                               lambda_weight=config.lambda_weight)
                       if policy == "zipage" else Variant(name, baseline=policy))
            out.append((policy, budget, variant))
    return out


def measured(reference: Reference, eos_ids: frozenset[int]) -> tuple[torch.Tensor, list]:
    """bool [prompts, continuation]: outputs 1 on (output 0 comes from the prefill, before any
    compression), up to and including the reference's first end-of-sequence."""
    length = len(reference.outputs[0]) if reference.outputs else 0
    mask = torch.zeros(len(reference.outputs), length, dtype=torch.bool)
    firsts = []
    for index, output in enumerate(reference.outputs):
        first = next((at for at, token in enumerate(output) if token in eos_ids), None)
        firsts.append(first)
        mask[index, 1:length if first is None else first + 1] = True
    return mask, firsts


def _compressions(run, group: int, copies: int) -> int:
    """Compressions of group `group`'s requests in `run` (from its request records)."""
    ids = {f"{group}/{index}" for index in range(copies)}
    return sum(record.n_compressions for record in run.requests if record.id in ids)


def run_needles(engine: Engine, cases: list[Needle], groups: int, answer_len: int,
                budget: Callable[[int], int | None] = lambda group: None,
                dispatcher: VariantDispatcher | None = None):
    """Greedy answers of every case once per group ("g/n"), side by side: the forced token,
    then `answer_len` free ones. Returns the run and each request's answer token ids."""
    requests = {f"{group}/{index}": case.prompt for group in range(groups)
                for index, case in enumerate(cases)}
    forced = {request_id: cases[int(request_id.split("/")[1])].forced for request_id in requests}
    counts = dict.fromkeys(requests, 0)

    def force_prefix(request_id: str, sampled: int) -> int:
        at = counts[request_id]
        counts[request_id] += 1
        return forced[request_id][at] if at < len(forced[request_id]) else sampled

    sampling = {request_id: SamplingParams(temperature=0.0, kv_budget=budget(
        int(request_id.split("/")[0]))) for request_id in requests}
    length = len(cases[0].forced) + answer_len
    recorder = run_requests(engine, requests, length, sampling, lambda *row: None,
                            next_token=force_prefix, dispatcher=dispatcher)
    answers = {request_id: recorder.run.tokens[request_id][len(prompt) + len(forced[request_id]):]
               for request_id, prompt in requests.items()}
    return recorder.run, answers


def run_names(settings: QualitySettings) -> list[str]:
    """The engine runs of a study, in order (what `progress` is told as each starts)."""
    return ([FULL_KV_REFERENCE, FULL_KV_FORCED] * bool(settings.prompts)
            + [FULL_KV_NEEDLE] * bool(settings.needles) + [POLICIES_FORCED] * bool(settings.prompts)
            + [POLICIES_NEEDLE] * bool(settings.needles))


def run_quality(model: torch.nn.Module, shape, tokenizer, spec: str, settings: QualitySettings,
                progress: Callable[[str], None] = lambda run: None) -> QualityResult:
    """The whole study on a loaded model; `progress(name)` as each run of `run_names` starts."""
    settings.check()
    eos = getattr(tokenizer, "eos_token_id", None)
    eos_ids = frozenset() if eos is None else frozenset(eos if isinstance(eos, list) else [eos])
    prompts = retell_prompts(tokenizer, settings)
    cases = needle_cases(tokenizer, settings)
    copies = max(len(prompts), len(cases))

    # Full KV: the reference, itself forced along it (the harness's zero), the needle.
    full = full_engine(model, shape, tokenizer, spec, settings, len(prompts) + len(cases))
    reference = Reference([], [], [], 0.0)
    full_row = QualityRow(FULL_KV, None, math.nan, math.nan, 0, 0, len(cases), 0)
    if prompts:
        progress(FULL_KV_REFERENCE)
        reference = generate_reference(full, prompts, settings.continuation_len, 0.0,
                                       settings.seed)
        progress(FULL_KV_FORCED)
        forced = force_reference(full, reference, 1)
    mask, firsts = measured(reference, eos_ids)
    if prompts:
        full_row.agreement, full_row.kl, full_row.positions = _means(forced, 0, mask)
    if cases:
        progress(FULL_KV_NEEDLE)
        _, answers = run_needles(full, cases, 1, settings.answer_len)
        _score_needles(full_row, tokenizer, cases, answers, 0, eos_ids)

    # Every policy x budget side by side in one compressed engine.
    policies = policies_engine(model, shape, tokenizer, spec, settings, copies)
    rows = [QualityRow(policy, budget, math.nan, math.nan, 0, 0, len(cases), 0)
            for policy, budget, _ in policies.variants]
    if prompts:
        progress(POLICIES_FORCED)
        forced = policies.force(reference)
        for group, row in enumerate(rows):
            row.agreement, row.kl, row.positions = _means(forced, group, mask)
            row.compressions += _compressions(forced.run, group, len(prompts))
    if cases:
        progress(POLICIES_NEEDLE)
        run, answers = run_needles(policies.engine, cases, len(rows), settings.answer_len,
                                   policies.budget, policies.dispatcher)
        for group, row in enumerate(rows):
            _score_needles(row, tokenizer, cases, answers, group, eos_ids)
            row.compressions += _compressions(run, group, len(cases))
    return QualityResult(settings, [full_row, *rows], firsts, [case.key for case in cases])


def _prompt_blocks(settings: QualitySettings) -> int:
    """Blocks one uncompressed request holds at most: its prompt, its outputs, one more."""
    return _blocks(settings.prompt_tokens + max(settings.continuation_len,
                                                settings.answer_len + 1) + 1,
                   settings.block_size)


def full_engine(model: torch.nn.Module, shape, tokenizer, spec: str, settings: QualitySettings,
                requests: int) -> Engine:
    """Full KV (compression off) for `requests` requests at once."""
    config = ZipageConfig(compress=False, block_size=settings.block_size, window=settings.window)
    return build_engine(model, shape, tokenizer, spec, config,
                        _prompt_blocks(settings) * requests + 1, 0)


@dataclass
class Policies:
    """The compressed engine every policy x budget shares: request "g/p" is variant g's copy of
    prompt p, with variant g's budget, compressed by its policy."""

    engine: Engine
    variants: list[tuple[str, int, Variant]]  # (policy, budget, variant), by group
    dispatcher: VariantDispatcher

    def budget(self, group: int, prompt: int = 0) -> int:
        return self.variants[group][1]

    def force(self, reference: Reference):
        """`force_reference` of every variant side by side (a `Forced`, groups = variants)."""
        return force_reference(self.engine, reference, len(self.variants), self.budget,
                               self.dispatcher)


def policies_engine(model: torch.nn.Module, shape, tokenizer, spec: str,
                    settings: QualitySettings, copies: int) -> Policies:
    """One engine for every policy x budget of `settings`, each with `copies` distinct prompts
    at once. Compression is synchronous (the dispatcher learns each step's requests before the
    step); blocks: each distinct prompt once (the copies share it through the prefix cache) and
    every request's budget, its new-token block and one spare."""
    config = ZipageConfig(block_size=settings.block_size, window=settings.window,
                          kv_budget=min(settings.budgets), async_compress=False)
    variants = variants_of(settings, config)
    requests = len(variants) * copies
    kept = sum(budget // settings.block_size + 2 for _, budget, _ in variants) * copies
    engine = build_engine(model, shape, tokenizer, spec, config,
                          _prompt_blocks(settings) * copies + kept + requests, requests)
    dispatcher = VariantDispatcher([variant for _, _, variant in variants], settings.seed)
    engine.runner.compressor.compress_fn = dispatcher
    for group, (_, _, variant) in enumerate(variants):
        for index in range(copies):
            dispatcher.variant_of[f"{group}/{index}"] = variant.name
    return Policies(engine, variants, dispatcher)


def _means(forced, group: int, mask: torch.Tensor) -> tuple[float, float, int]:
    positions = int(mask.sum())
    if not positions:
        return math.nan, math.nan, 0
    return (float(forced.agreement[group][mask].double().mean()),
            float(forced.kl[group][mask].mean()), positions)


def _score_needles(row: QualityRow, tokenizer, cases: list[Needle], answers: dict,
                   group: int, eos_ids: frozenset[int]) -> None:
    for index, case in enumerate(cases):
        tokens = answers[f"{group}/{index}"]
        cut = next((at for at, token in enumerate(tokens) if token in eos_ids), len(tokens))
        text = tokenizer.decode(tokens[:cut])
        row.needle_texts.append(text)
        row.needle_hits += needle_hit(text, case.key)


# --------------------------------------------------------------------------- output

def _percent(value: float) -> str:
    return "-" if math.isnan(value) else f"{100 * value:.1f}"


def format_table(result: QualityResult) -> str:
    """The markdown table `zipage quality` prints and docs/BENCHMARKS.md keeps."""
    lines = ["| policy | budget | agreement % | mean KL (nats) | needle % | compressions |",
             "|---|---:|---:|---:|---:|---:|"]
    for row in result.rows:
        kl = "-" if math.isnan(row.kl) else f"{row.kl:.4f}"
        needle = (f"{_percent(row.needle_rate)} ({row.needle_hits}/{row.needles})"
                  if row.needles else "-")
        lines.append(f"| {row.policy} | {'-' if row.budget is None else row.budget} | "
                     f"{_percent(row.agreement)} | {kl} | {needle} | {row.compressions} |")
    return "\n".join(lines)


def describe(result: QualityResult) -> str:
    """The line under the table: what was measured over how many positions."""
    settings = result.settings
    positions = result.rows[0].positions if result.rows else 0
    return (f"{settings.prompts} prompts x {settings.continuation_len} forced tokens "
            f"({positions} positions measured per row), {settings.needles} needles; prompts of "
            f"{settings.prompt_tokens} tokens, block {settings.block_size}, window "
            f"{settings.window}, seed {settings.seed}, greedy")


def write_result(result: QualityResult, path: Path) -> None:
    """The table as CSV (one row per line), or as JSON with the settings (`.json`)."""
    rows = [{key: value for key, value in asdict(row).items() if key != "needle_texts"}
            | {"needle_rate": row.needle_rate} for row in result.rows]
    if path.suffix == ".json":
        path.write_text(json.dumps({"settings": asdict(result.settings),
                                    "reference_eos": result.reference_eos, "rows": rows,
                                    "needle_keys": result.needle_keys,
                                    "needle_answers": {f"{row.policy}@{row.budget}":
                                                       row.needle_texts
                                                       for row in result.rows}},
                                   indent=1, allow_nan=True) + "\n")
        return
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
