"""Generators of the paper's workload shapes as traces.

The paper evaluates Zipage on AMC 23 (40 questions x 32 samples, short prompts, long reasoning),
GSM8K in Qwen3's non-thinking mode (1319 x 4, short prompts, mostly short answers with an
occasional long reasoning tail), their mixture ((40 + 1319) x 4, question order shuffled) and
LongBench MultiFieldQA (150 x 4, prompts of several thousand tokens, answers of about 400 tokens).
We do not ship the datasets or model outputs; each generator draws prompt and output lengths from
lognormal distributions whose parameters rest on published statistics (the paper's where it gives
them, stated assumptions elsewhere; see `docs/traces.md`). Samples of one question have identical
prompts, so they form a prefix group over the whole prompt. Every length is a pure function of
(seed, dataset, question, sample), so a trace is reproducible and the mixture is exactly the GSM8K
trace plus the first 4 samples of every AMC 23 question.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from zipage.errors import ConfigError
from zipage.session_workloads import SESSION_WORKLOADS
from zipage.trace import Trace, TraceRequest, stable_hash, stamp_arrivals


@dataclass(frozen=True)
class LengthModel:
    """A token count: lognormal, with a question effect shared by all samples of a question.

    log(length) = log(median) + question_sigma * z_question + sample_sigma * z_sample, where the
    z are standard normals; with probability `tail_probability` a sample instead takes
    tail_median * exp(tail_sigma * z_sample) (a runaway reasoning trace). The result is rounded
    and clipped to [minimum, min(maximum, cap)]; generation stops at the output cap, so samples
    pile up there as they do in a real run.
    """

    median: float
    question_sigma: float
    sample_sigma: float = 0.0
    minimum: int = 1
    maximum: int | None = None
    tail_probability: float = 0.0
    tail_median: float = 0.0
    tail_sigma: float = 0.0

    def length(self, question_shift: float, sample_shift: float = 0.0, in_tail: bool = False,
               cap: int | None = None) -> int:
        """The token count for standard-normal shifts; `cap` lowers the maximum (output caps)."""
        if in_tail:
            log_length = math.log(self.tail_median) + self.tail_sigma * sample_shift
        else:
            log_length = (
                math.log(self.median)
                + self.question_sigma * question_shift
                + self.sample_sigma * sample_shift
            )
        length = max(self.minimum, round(math.exp(log_length)))
        limits = [limit for limit in (self.maximum, cap) if limit is not None]
        return min(length, *limits) if limits else length

    def sample(self, question_shift: float, generator: np.random.Generator, cap: int | None) -> int:
        """One sample's token count, drawing its tail choice and its own shift from `generator`."""
        in_tail = generator.random() < self.tail_probability
        return self.length(question_shift, generator.standard_normal(), in_tail, cap)


@dataclass(frozen=True)
class DatasetShape:
    """How one benchmark's requests look: its prompt length and its output length."""

    name: str
    prompt: LengthModel
    output: LengthModel
    # Tokens after the long document in the prompt (instruction, question, chat template); None
    # for datasets whose prompt has no separate document.
    question_tail: LengthModel | None = None


# AMC 23 in Qwen3's thinking mode. Prompt: problem statement (~60-120 tokens) plus the
# "reason step by step ... \boxed{}" instruction and chat template (~25 tokens). Output: assumed
# mean ~8.6k tokens before the 16384 cap, ~9% of samples hitting the cap (the paper gives no
# number; see docs/traces.md). The question effect makes hard questions long for all samples.
AMC23 = DatasetShape(
    name="amc23",
    prompt=LengthModel(median=110, question_sigma=0.35, minimum=40, maximum=400),
    output=LengthModel(median=7000, question_sigma=0.5, sample_sigma=0.4),
)

# GSM8K in Qwen3's non-thinking mode. Prompt: question (~46 words, ~60 tokens) plus template.
# Output: step-by-step answers of ~250 tokens; 2% of samples fall into lengthy reasoning (the paper:
# "the model occasionally generates lengthy reasoning"), a few of which run to the cap.
GSM8K = DatasetShape(
    name="gsm8k",
    prompt=LengthModel(median=85, question_sigma=0.3, minimum=30, maximum=300),
    output=LengthModel(
        median=240, question_sigma=0.35, sample_sigma=0.2,
        tail_probability=0.02, tail_median=2500, tail_sigma=0.9,
    ),
)

# LongBench MultiFieldQA-en: 150 documents averaging 4,559 words (LongBench's table), ~1.3 tokens
# per word -> ~5.9k tokens. Output: the paper's "average output length on LongBench is only 400
# tokens", with 5% of samples in a long tail ("occasional requests may produce significantly
# longer outputs").
LONGBENCH = DatasetShape(
    name="longbench",
    prompt=LengthModel(median=5230, question_sigma=0.5, minimum=800, maximum=14000),
    question_tail=LengthModel(median=60, question_sigma=0.25, minimum=30, maximum=200),
    output=LengthModel(
        median=295, question_sigma=0.4, sample_sigma=0.3,
        tail_probability=0.05, tail_median=1500, tail_sigma=0.5,
    ),
)


def amc23(seed: int = 0, *, num_questions: int = 40, samples_per_question: int = 32,
          max_output_len: int = 16384) -> Trace:
    """AMC 23: short prompts, long reasoning outputs; 40 x 32 = 1280 requests."""
    _check_counts(num_questions=num_questions, samples_per_question=samples_per_question,
                  max_output_len=max_output_len)
    questions = _question_groups(AMC23, seed, num_questions, samples_per_question, max_output_len)
    return Trace(name="amc23", requests=[request for group in questions for request in group])


def gsm8k(seed: int = 0, *, num_questions: int = 1319, samples_per_question: int = 4,
          max_output_len: int = 16384) -> Trace:
    """GSM8K (non-thinking): short prompts, short outputs with a rare long tail; 1319 x 4 = 5276."""
    _check_counts(num_questions=num_questions, samples_per_question=samples_per_question,
                  max_output_len=max_output_len)
    questions = _question_groups(GSM8K, seed, num_questions, samples_per_question, max_output_len)
    return Trace(name="gsm8k", requests=[request for group in questions for request in group])


def mixture(seed: int = 0, *, num_amc23_questions: int = 40, num_gsm8k_questions: int = 1319,
            samples_per_question: int = 4, max_output_len: int = 16384) -> Trace:
    """AMC 23 + GSM8K questions, 4 samples each, question order shuffled; (40 + 1319) x 4 = 5436.

    Samples of a question stay adjacent, as when a client asks for n samples of one prompt.
    """
    _check_counts(num_amc23_questions=num_amc23_questions, num_gsm8k_questions=num_gsm8k_questions,
                  samples_per_question=samples_per_question, max_output_len=max_output_len)
    questions = (
        _question_groups(AMC23, seed, num_amc23_questions, samples_per_question, max_output_len)
        + _question_groups(GSM8K, seed, num_gsm8k_questions, samples_per_question, max_output_len)
    )
    order = _generator(seed, "mixture", "question order").permutation(len(questions))
    return Trace(name="mixture", requests=[request for i in order for request in questions[i]])


def longbench(seed: int = 0, *, num_questions: int = 150, samples_per_question: int = 4,
              max_output_len: int = 4096) -> Trace:
    """LongBench MultiFieldQA: ~6k-token shared prompts, ~400-token outputs; 150 x 4 = 600."""
    _check_counts(num_questions=num_questions, samples_per_question=samples_per_question,
                  max_output_len=max_output_len)
    questions = _question_groups(
        LONGBENCH, seed, num_questions, samples_per_question, max_output_len
    )
    return Trace(name="longbench", requests=[request for group in questions for request in group])


# ---------------------------------------------------------------- online shapes
# Serving-shaped traces with Poisson arrivals built in (`rate_qps`; stamp another rate with
# `zipage trace make FILE --rate R`). Their lengths are uniform within stated ranges: they are
# stress shapes for the scheduler and the twins, not models of a published dataset.

def rag(seed: int = 0, *, num_requests: int = 100, rate_qps: float = 2.0, num_documents: int = 4,
        document_len: int = 2048, prompt_len_range: tuple[int, int] = (2500, 4000),
        output_len_range: tuple[int, int] = (300, 1500)) -> Trace:
    """Retrieval-augmented questions: each prompt starts with one of `num_documents` shared
    documents of `document_len` tokens, then its own question; moderate answers."""
    _check_counts(num_requests=num_requests, num_documents=num_documents,
                  document_len=document_len)
    _check_range("prompt_len_range", prompt_len_range, minimum=document_len + 1)
    _check_range("output_len_range", output_len_range)
    generator = _generator(seed, "rag")
    requests = []
    for index in range(num_requests):
        document = int(generator.integers(num_documents))
        requests.append(TraceRequest(
            id=f"rag-{index}", arrival_s=0.0,
            prompt_len=_uniform(generator, prompt_len_range),
            output_len=_uniform(generator, output_len_range),
            prefix_group=f"rag-doc{document}", prefix_len=document_len))
    return _online("rag", requests, rate_qps, seed)


def chat(seed: int = 0, *, num_requests: int = 200, rate_qps: float = 8.0,
         prompt_len_range: tuple[int, int] = (50, 600),
         output_len_range: tuple[int, int] = (50, 500)) -> Trace:
    """Short chat turns: short prompts, short answers, nothing shared."""
    _check_counts(num_requests=num_requests)
    _check_range("prompt_len_range", prompt_len_range)
    _check_range("output_len_range", output_len_range)
    generator = _generator(seed, "chat")
    requests = [TraceRequest(id=f"chat-{index}", arrival_s=0.0,
                             prompt_len=_uniform(generator, prompt_len_range),
                             output_len=_uniform(generator, output_len_range))
                for index in range(num_requests)]
    return _online("chat", requests, rate_qps, seed)


def online_mixture(seed: int = 0, *, num_requests: int = 160, rate_qps: float = 4.0,
                   max_output_len: int = 4096) -> Trace:
    """Online reasoning mixture: 60 % reasoning requests (AMC 23-like prompts, 1.5k-4k outputs),
    30 % short requests (0.2k-1.2k prompts, 100-600 outputs), 10 % 2k-3k prompts sharing one of
    two 1k-token prefixes (200-800 outputs); shuffled, Poisson arrivals."""
    _check_counts(num_requests=num_requests, max_output_len=max_output_len)
    generator = _generator(seed, "online-mixture")
    requests = []
    for index in range(num_requests):
        draw = generator.random()
        if draw < 0.6:
            prompt, output, group = _uniform(generator, (60, 250)), _uniform(
                generator, (1500, 4000)), None
        elif draw < 0.9:
            prompt, output, group = _uniform(generator, (200, 1200)), _uniform(
                generator, (100, 600)), None
        else:
            prompt, output = _uniform(generator, (2000, 3000)), _uniform(generator, (200, 800))
            group = f"online-mixture-prefix{int(generator.integers(2))}"
        requests.append(TraceRequest(
            id=f"online-mixture-{index}", arrival_s=0.0, prompt_len=prompt,
            output_len=min(output, max_output_len), prefix_group=group,
            prefix_len=1024 if group else 0))
    return _online("online-mixture", requests, rate_qps, seed)


def _online(name: str, requests: list[TraceRequest], rate_qps: float, seed: int) -> Trace:
    if isinstance(rate_qps, bool) or not isinstance(rate_qps, (int, float)) or not rate_qps > 0:
        raise ConfigError(f"rate_qps must be a number > 0 (requests per second), got {rate_qps!r}")
    return stamp_arrivals(Trace(name=name, requests=requests), float(rate_qps), seed=seed)


def _uniform(generator: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(generator.integers(bounds[0], bounds[1] + 1))


def _check_range(name: str, bounds: tuple[int, int], minimum: int = 1) -> None:
    if (not isinstance(bounds, (tuple, list)) or len(bounds) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in bounds)
            or not minimum <= bounds[0] <= bounds[1]):
        raise ConfigError(f"{name} must be two integers (low, high) with {minimum} <= low <= "
                          f"high, got {bounds!r}")


# (id, prompt_len, prefix_group, prefix_len, output_len). Prompt and output lengths sit on and
# around multiples of 16, 32, 64 and 256 so every block size a test uses meets an exactly full
# block, one token short and one token over; two groups share a prefix that is the whole prompt
# of some members and part of the prompt of others.
_TINY_REQUESTS: tuple[tuple[str, int, str | None, int, int], ...] = (
    ("tiny-p1", 1, None, 0, 1),
    ("tiny-p15", 15, None, 0, 2),
    ("tiny-p16", 16, None, 0, 16),
    ("tiny-p17", 17, None, 0, 17),
    ("tiny-p31", 31, None, 0, 33),
    ("tiny-p32", 32, None, 0, 48),
    ("tiny-p33", 33, None, 0, 64),
    ("tiny-p63", 63, None, 0, 65),
    ("tiny-p64", 64, None, 0, 100),
    ("tiny-p65", 65, None, 0, 129),
    ("tiny-p255", 255, None, 0, 31),
    ("tiny-p256", 256, None, 0, 200),
    ("tiny-p257", 257, None, 0, 256),
    ("tiny-shared-a", 96, "tiny-shared", 96, 40),
    ("tiny-shared-b", 96, "tiny-shared", 96, 150),
    ("tiny-shared-c", 130, "tiny-shared", 96, 280),
    ("tiny-document-a", 300, "tiny-document", 256, 24),
    ("tiny-document-b", 280, "tiny-document", 256, 300),
)


def tiny(seed: int = 0) -> Trace:
    """A fixed 18-request trace for tests and demos; `seed` is accepted for a uniform interface."""
    return Trace(
        name="tiny",
        requests=[
            TraceRequest(id=request_id, arrival_s=0.0, prompt_len=prompt_len, output_len=output_len,
                         prefix_group=group, prefix_len=prefix_len)
            for request_id, prompt_len, group, prefix_len, output_len in _TINY_REQUESTS
        ],
    )


WORKLOADS: dict[str, Callable[..., Trace]] = {
    "amc23": amc23,
    "gsm8k": gsm8k,
    "mixture": mixture,
    "longbench": longbench,
    "tiny": tiny,
    "rag": rag,
    "chat": chat,
    "online-mixture": online_mixture,
}

# Every kind `make_trace` makes: the shapes above (each shipped as traces/KIND.json) and the
# session shapes of zipage/session_workloads.py (chat, coding agent, deep research).
ALL_WORKLOADS: dict[str, Callable[..., Trace]] = {**WORKLOADS, **SESSION_WORKLOADS}


def make_trace(kind: str, seed: int = 0, **overrides: Any) -> Trace:
    """Generate workload `kind` with `seed`; `overrides` are the generator's keyword arguments."""
    if kind not in ALL_WORKLOADS:
        raise ConfigError(f"unknown workload kind {kind!r}; known kinds: "
                          f"{', '.join(ALL_WORKLOADS)}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ConfigError(f"seed must be an integer >= 0, got {seed!r}")
    generator = ALL_WORKLOADS[kind]
    accepted = [
        name for name, parameter in inspect.signature(generator).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    unknown = [name for name in overrides if name not in accepted]
    if unknown:
        raise ConfigError(
            f"workload {kind!r} has no option {', '.join(map(repr, unknown))}; "
            f"its options are: {', '.join(accepted) if accepted else 'none'}"
        )
    return generator(seed, **overrides)


def _question_groups(dataset: DatasetShape, seed: int, num_questions: int,
                     samples_per_question: int, max_output_len: int) -> list[list[TraceRequest]]:
    groups = []
    for question in range(num_questions):
        # Draw order is part of the format: prompt, question tail, output question effect.
        question_generator = _generator(seed, dataset.name, "question", question)
        prompt_len = dataset.prompt.length(question_generator.standard_normal())
        if dataset.question_tail is not None:
            prompt_len += dataset.question_tail.length(question_generator.standard_normal())
        output_shift = question_generator.standard_normal()
        group = f"{dataset.name}-q{question}"
        groups.append([
            TraceRequest(
                id=f"{group}-s{sample}",
                arrival_s=0.0,
                prompt_len=prompt_len,
                output_len=dataset.output.sample(
                    output_shift, _generator(seed, dataset.name, "sample", question, sample),
                    cap=max_output_len,
                ),
                prefix_group=group,
                prefix_len=prompt_len,
            )
            for sample in range(samples_per_question)
        ])
    return groups


def _generator(seed: int, *keys: str | int) -> np.random.Generator:
    # Each key (dataset, purpose, question, sample) gets its own stream, so a question's lengths
    # do not depend on how many questions or samples are generated around it.
    entropy = [seed] + [key if isinstance(key, int) else stable_hash(key) for key in keys]
    return np.random.default_rng(entropy)


def _check_counts(**counts: Any) -> None:
    for name, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
