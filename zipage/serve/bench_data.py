"""`zipage bench serve`'s workloads: a trace, vLLM's `random` and `sharegpt` datasets, and the
arrival process of `--request-rate` / `--burstiness`, each turned into one `Trace`.

Every dataset becomes the request list a trace file is (ids, arrival times, prompt and output
lengths, prompt token ids), so `zipage.serve.bench` has one sending and recording path whatever
the source, and the run directory it writes is one `zipage compare` and the simulator read.
A text dataset (ShareGPT; `random` given a tokenizer) also keeps each prompt's text: that is
what is sent (the server tokenizes it, as for any client), and what the chat endpoint needs;
its token ids, from `--tokenizer`, give the request its prompt length.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zipage.errors import ZipageError
from zipage.trace import DEFAULT_VOCAB_SIZE, SYNTHETIC_TOKEN_HIGH, SYNTHETIC_TOKEN_LOW, Trace, TraceRequest, restamp

DATASETS = ("trace", "random", "sharegpt")
# vLLM's defaults for its synthetic and sampled datasets.
DEFAULT_NUM_PROMPTS = 1000
# A random text prompt is re-tokenized after decoding (merges change the count): this many
# rounds of trimming or padding bring it to its length, or as near as the tokenizer allows.
_RANDOM_TEXT_ROUNDS = 4


@dataclass(frozen=True)
class Workload:
    """What is sent: the requests (a trace's, whatever the dataset), and for a text dataset
    each prompt's text by request id (None: the prompts are sent as token ids)."""

    trace: Trace
    texts: dict[str, str] | None = None


@dataclass(frozen=True)
class RandomSpec:
    """vLLM's `--dataset-name random`: lengths drawn uniformly within +-`range_ratio` of
    `input_len` and `output_len`; every prompt starts with the same `prefix_len` tokens."""

    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 0


def load_bench_tokenizer(spec: str):
    """`--tokenizer`: a HF model directory or a .gguf file, read as `zipage serve` reads the
    model's (the same ids, the same text)."""
    from zipage.errors import UnknownModelError

    if not Path(spec).expanduser().exists():
        raise ZipageError(f"--tokenizer: {spec} does not exist; pass a HF model directory or a "
                          ".gguf file (the served model's)")
    try:
        from zipage.engine.loader import load_tokenizer

        tokenizer = load_tokenizer(spec)
    except ImportError as error:
        raise ZipageError(f"--tokenizer needs the engine extra ({error.name} is missing): "
                          "pip install 'zipage[engine,gguf]'") from None
    except UnknownModelError as error:
        raise ZipageError(f"--tokenizer: {str(error).removeprefix('model: ')}") from None
    if tokenizer is None:
        raise ZipageError(f"--tokenizer: {spec} ships no tokenizer files (tokenizer.json, "
                          "tokenizer_config.json or tokenizer.model)")
    return tokenizer


def trace_workload(trace: Trace, num_prompts: int | None) -> Workload:
    """A trace's first `num_prompts` requests (all of them: None), sent as token ids. A
    follow-up always comes after the turn it follows, so a cut keeps every session whole up to
    the cut."""
    requests = trace.requests if num_prompts is None else trace.requests[:num_prompts]
    return Workload(Trace(name=trace.name, requests=list(requests)))


def random_workload(spec: RandomSpec, num_prompts: int, seed: int, tokenizer=None,
                    vocab_size: int = DEFAULT_VOCAB_SIZE) -> Workload:
    """`num_prompts` random prompts: token ids without a tokenizer (drawn as a trace's
    synthetic ids are, from [100, min(vocab_size, 32000))), text with one (ids drawn from its
    vocabulary, less its special tokens, decoded)."""
    rng = np.random.default_rng(seed)
    input_lens = _lengths(rng, spec.input_len, spec.range_ratio, num_prompts, 1)
    output_lens = _lengths(rng, spec.output_len, spec.range_ratio, num_prompts, 1)
    vocabulary = _vocabulary(tokenizer, vocab_size)
    prefix = vocabulary[rng.integers(0, len(vocabulary), spec.prefix_len)].tolist()
    requests, texts = [], {} if tokenizer is not None else None
    for index, (input_len, output_len) in enumerate(zip(input_lens, output_lens)):
        ids = prefix + vocabulary[rng.integers(0, len(vocabulary), input_len)].tolist()
        request_id = f"random-{index}"
        if tokenizer is not None:
            texts[request_id], ids = _random_text(tokenizer, ids, vocabulary, rng)
        requests.append(TraceRequest(id=request_id, arrival_s=0.0, prompt_len=len(ids),
                                     output_len=output_len, prompt_token_ids=ids))
    return Workload(Trace(name="random", requests=requests), texts)


def sharegpt_workload(path: str, num_prompts: int, seed: int, tokenizer,
                      output_len: int | None = None) -> Workload:
    """ShareGPT conversations (a JSON list of {"conversations": [{"from": "human", "value":
    ...}, {"from": "gpt", "value": ...}, ...]}): each one's first human turn is a prompt, and
    the gpt turn after it, tokenized, its output length (`output_len` instead, if given).
    Conversations are shuffled by `seed`; fewer than `num_prompts` are used again, in the same
    order (vLLM oversamples too)."""
    pairs = _sharegpt_pairs(path)
    order = np.random.default_rng(seed).permutation(len(pairs))
    requests, texts = [], {}
    for index in range(num_prompts):
        prompt, answer = pairs[order[index % len(pairs)]]
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        length = output_len or len(tokenizer.encode(answer, add_special_tokens=False))
        if not ids or length < 1:  # nothing to send, or nothing to generate
            continue
        request_id = f"sharegpt-{index}"
        texts[request_id] = prompt
        requests.append(TraceRequest(id=request_id, arrival_s=0.0, prompt_len=len(ids),
                                     output_len=length, prompt_token_ids=ids))
    if not requests:
        raise ZipageError(f"--dataset-path: {path}: no conversation has both a prompt and an "
                          "answer of at least one token")
    return Workload(Trace(name=Path(path).stem, requests=requests), texts)


def retime(trace: Trace, rate: float, burstiness: float, seed: int) -> Trace:
    """The trace with the requests that follow none re-timed to `rate` per second, in trace
    order, the first at 0: gaps drawn from a gamma distribution of shape `burstiness` and mean
    1 / rate (1: a Poisson process; below 1 burstier, above 1 steadier), vLLM's process; `rate`
    inf: all at 0. A session's follow-ups keep their closed loop (`after`, `after_s`); their
    `arrival_s`, a lower bound drivers only sort by, becomes their session's new start."""
    opening = sum(request.after is None for request in trace.requests)
    if math.isinf(rate):
        arrivals = np.zeros(opening)
    else:
        rng = np.random.default_rng([seed, 0xA7])
        gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=opening)
        gaps[:1] = 0.0
        arrivals = np.cumsum(gaps)
    return restamp(trace, arrivals)


def _lengths(rng: np.random.Generator, mean: int, ratio: float, count: int,
             low: int) -> list[int]:
    """`count` lengths uniform over [mean * (1 - ratio), mean * (1 + ratio)], at least `low`."""
    lower = max(low, math.floor(mean * (1 - ratio)))
    upper = max(lower, math.ceil(mean * (1 + ratio)))
    return rng.integers(lower, upper + 1, count).tolist()


def _vocabulary(tokenizer, vocab_size: int) -> np.ndarray:
    """The ids random prompts are drawn from: a tokenizer's, less its special tokens (they
    would be read as control tokens); else the synthetic ids a trace uses."""
    if tokenizer is None:
        return np.arange(SYNTHETIC_TOKEN_LOW, min(vocab_size, SYNTHETIC_TOKEN_HIGH))
    special = set(tokenizer.all_special_ids)
    return np.array([i for i in range(len(tokenizer)) if i not in special])


def _random_text(tokenizer, ids: list[int], vocabulary: np.ndarray,
                 rng: np.random.Generator) -> tuple[str, list[int]]:
    """Random ids as text whose tokenization is (near) `len(ids)` tokens: decoding then
    encoding merges or splits tokens, so the text is trimmed or padded and encoded again."""
    target = len(ids)
    for _ in range(_RANDOM_TEXT_ROUNDS):
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == target:
            break
        ids = (ids[:target] if len(ids) > target else
               ids + vocabulary[rng.integers(0, len(vocabulary), target - len(ids))].tolist())
    text = tokenizer.decode(ids)
    return text, tokenizer.encode(text, add_special_tokens=False)


def _sharegpt_pairs(path: str) -> list[tuple[str, str]]:
    """(first human turn, the gpt turn after it) of each conversation that has both."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ZipageError(f"--dataset-path: {path} does not exist") from None
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ZipageError(f"--dataset-path: {path} is not a ShareGPT JSON file ({error})") from None
    if not isinstance(data, list):
        raise ZipageError(f"--dataset-path: {path}: expected a JSON list of "
                          '{"conversations": [...]} objects (ShareGPT), got '
                          f"{type(data).__name__}")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            continue
        for first, second in zip(turns, turns[1:]):
            if (isinstance(first, dict) and isinstance(second, dict)
                    and first.get("from") == "human" and second.get("from") == "gpt"
                    and isinstance(first.get("value"), str)
                    and isinstance(second.get("value"), str)):
                pairs.append((first["value"], second["value"]))
                break
    if not pairs:
        raise ZipageError(f"--dataset-path: {path}: no conversation with a human turn followed "
                          "by a gpt turn (ShareGPT's format)")
    return pairs
