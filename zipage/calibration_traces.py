"""Traces sized to one deployment: what `zipage calibrate` runs through the engine to fit a cost
profile, the held-out trace it validates the profile on, and the fresh traces `zipage fidelity`
checks the twin with.

A trace that must run for about N seconds on whatever GPU, model and memory it meets cannot
name fixed request counts or rates: a 0.6B model decodes four times as fast as an 8B one, and a
Full-KV cache of 6 GB holds a tenth of the requests a compressed one does. So every trace here is
drawn from a shape (prompt and output lengths, arrivals, prefix sharing) and sized by an
`EngineSpeed` - a decode step and a prefill token of this engine, measured by a quick probe
(zipage/engine/calibrate.py), and its capacity - into an offered load: requests arrive at
`load` times the rate the engine can serve (load 0.7: a busy engine; 1.8: arrivals above
capacity), and for as many seconds as asked. Lengths are clipped to the deployment (the model's
length, the KV pool, the step's token limit), so every trace runs everywhere.

The fitting traces and the checking traces share no shape and no seed: a profile is never judged
on what it was fitted to (docs/cost_model.md, 'Calibrating through the engine loop').
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from zipage.trace import Trace, TraceRequest, stable_hash

# At least this many requests a trace, and at most this many (a CPU engine is slow; the probe
# only estimates speed, and a trace 3x too long should not run for an hour).
MIN_REQUESTS = 6
MAX_REQUESTS = 2000
# Seconds of traffic `zipage calibrate` fits on (in all) and validates on, by default: a few
# minutes of a GPU, including the probe, the warm-up and the grid beyond the runs.
DEFAULT_FIT_SECONDS = 120.0
DEFAULT_VALIDATION_SECONDS = 30.0
# Tokens one block hash names in the Mooncake-shaped trace (its traces' own size).
HASH_BLOCK_TOKENS = 512
# The long-context fitting trace (`_long_contexts`): prompts from 4k to 24k tokens (clipped to the
# deployment), in this many chains that each send their next request when the last one ends,
# beside short requests arriving at a rate that keeps about SHORT_RUNNING of them decoding.
LONG_PROMPTS = (4096, 24_576)
LONG_CHAINS = 2
SHORT_RUNNING = 4


@dataclass(frozen=True)
class EngineSpeed:
    """One engine's speed and capacity, as a probe measured them: what sizes a trace in seconds."""

    decode_step_s: float  # a decode step at `concurrency` requests
    prefill_token_s: float  # seconds per prompt token of a long prefill
    concurrency: int  # most requests decoding at once (query slots, max_num_seqs)
    kv_tokens: int  # KV entries the pool holds
    max_model_len: int
    block_size: int
    kv_budget: int | None  # None: Full KV (no compression)
    step_tokens: int  # most tokens one step computes (max_num_batched_tokens)

    def running(self, prompt: float, output: float) -> float:
        """Requests of these mean lengths that run at once: the slots, or what the KV holds of
        their mean context (a compressed request holds at most its budget and a block)."""
        context = prompt + output / 2
        if self.kv_budget is not None:
            context = min(context, self.kv_budget + self.block_size)
        return max(1.0, min(self.concurrency, self.kv_tokens / max(context, 1.0)))

    def request_seconds(self, prompt: float, output: float) -> float:
        """Engine seconds one request of these mean lengths costs a busy engine: its prompt's
        prefill, and its share of the decode steps it runs in."""
        return (prompt * self.prefill_token_s
                + output * self.decode_step_s / self.running(prompt, output))

    @property
    def prompt_cap(self) -> int:
        """The longest prompt a trace gives this deployment: a third of the KV pool (room for
        others), within the model's length less room for an output."""
        return max(16, min(self.kv_tokens // 3, self.max_model_len // 2))

    @property
    def compresses(self) -> bool:
        return self.kv_budget is not None


# One request of a shape: (prompt_len, output_len, extra TraceRequest fields).
Draw = Callable[[np.random.Generator, int], tuple[int, int, dict]]


def lognormal(median: float, mean: float) -> Callable[[np.random.Generator], float]:
    """A lognormal with this median and mean (sigma^2 = 2 ln(mean / median))."""
    sigma = math.sqrt(2.0 * math.log(mean / median))
    return lambda rng: float(median * math.exp(sigma * rng.standard_normal()))


def sized_trace(name: str, speed: EngineSpeed, seconds: float, load: float, draw: Draw,
                seed: int, arrivals: str = "poisson", burst: int = 8) -> Trace:
    """`draw`'s requests arriving at `load` times the rate `speed` serves them, for about
    `seconds` of engine time (at most MAX_REQUESTS, at least MIN_REQUESTS): above capacity
    the arrivals span seconds / load, and the engine drains the rest. `arrivals`: poisson; bursts (groups
    of 1..2x`burst` at once, the groups a Poisson process); once (every request at 0)."""
    rng = np.random.default_rng([seed, stable_hash(name)])
    sample = [draw(rng, -1) for _ in range(512)]
    prompt = float(np.mean([p for p, _, _ in sample]))
    output = float(np.mean([o for _, o, _ in sample]))
    rate = load / speed.request_seconds(prompt, output)
    count = int(min(MAX_REQUESTS, max(MIN_REQUESTS, round(rate * seconds / max(1.0, load)))))
    drawn = [draw(rng, index) for index in range(count)]
    if arrivals == "once":
        times = np.zeros(count)
    elif arrivals == "bursts":
        sizes = rng.integers(1, 2 * burst + 1, size=count)
        starts = np.cumsum(rng.exponential(sizes / rate))
        times = np.repeat(starts - starts[0], sizes)[:count]
    else:
        times = np.cumsum(rng.exponential(1.0 / rate, size=count))
        times -= times[0]
    requests = [TraceRequest(id=f"{name}-{index}", arrival_s=round(float(time), 6),
                             prompt_len=prompt_len, output_len=output_len, **extra)
                for index, ((prompt_len, output_len, extra), time) in enumerate(zip(drawn, times))]
    return Trace(name=name, requests=requests)


def _clip(value: float, low: int, high: int) -> int:
    return int(min(high, max(low, round(value))))


def _lengths(speed: EngineSpeed, prompt: Callable, output: Callable, output_cap: int | None = None,
             prompt_cap: int | None = None) -> Draw:
    """Independent prompt and output lengths, clipped to the deployment."""
    top = min(prompt_cap or speed.prompt_cap, speed.prompt_cap)
    most = output_cap or speed.max_model_len

    def draw(rng: np.random.Generator, index: int) -> tuple[int, int, dict]:
        prompt_len = _clip(prompt(rng), 1, top)
        output_len = _clip(output(rng), 1, min(most, speed.max_model_len - prompt_len - 1))
        return prompt_len, output_len, {}
    return draw


def _long_outputs(speed: EngineSpeed, low: float, high: float) -> Callable:
    """Outputs long enough to compress (low..high budgets), or on a Full-KV deployment long
    enough to hold a request's memory (low..high x 512 tokens)."""
    unit = speed.kv_budget or 512
    return lambda rng: rng.uniform(low * unit, high * unit)


# ---------------------------------------------------------------- the fitting traces

def fit_traces(speed: EngineSpeed, seconds: float, seed: int = 0) -> list[tuple[Trace, dict]]:
    """The traces `zipage calibrate` fits a profile on, each with the config changes its run
    makes (one prefills whole prompts, whatever the deployment does): online arrivals of short
    requests; long prompts (unchunked: the prefill points of whole long prompts); a burst beyond
    the KV pool (preemption and recompute; compression batches); documents shared by many
    questions (decode steps that read shared prefix blocks); documents read in with short
    answers (prefill-heavy: prompt chunks beside few decodes); long uncompressed contexts at
    small batches (what pins the decode fit's context slope beside the longest request's term).
    `seconds` is the whole fitting time, shared among them equally."""
    each = seconds / 6
    budget_out = 4 * (speed.kv_budget or 512)
    online = _lengths(speed, lognormal(400, 700), lognormal(180, 300), output_cap=budget_out)
    long_cap = min(speed.prompt_cap, 16_384)
    # Log-uniform from a few blocks to the cap: whole prompts short and long, so that a prefill
    # step's tokens and its attention pairs (their square) vary apart.
    shortest = min(256, long_cap)
    long = _lengths(speed, lambda rng: math.exp(rng.uniform(math.log(shortest), math.log(long_cap))),
                    _long_outputs(speed, 1.0, 3.0), prompt_cap=long_cap)
    pressure = _lengths(speed, lognormal(1200, 1600), _long_outputs(speed, 1.0, 4.0))
    ingest = _lengths(speed, lambda rng: rng.uniform(512, 6144), lambda rng: rng.uniform(1, 64))
    return [
        (sized_trace("fit-online", speed, each, 0.7, online, seed), {}),
        (sized_trace("fit-long", speed, each, 0.8, long, seed), {"chunked_prefill": False}),
        (sized_trace("fit-pressure", speed, each, 2.5, pressure, seed, arrivals="bursts",
                     burst=32), {}),
        (sized_trace("fit-shared", speed, each, 0.8, _documents(speed), seed), {}),
        (sized_trace("fit-ingest", speed, each, 0.9, ingest, seed), {}),
        (_long_contexts("fit-longctx", speed, each, seed), {}),
    ]


def _long_contexts(name: str, speed: EngineSpeed, seconds: float, seed: int) -> Trace:
    """Long uncompressed contexts at small batches: LONG_CHAINS chains of requests with long
    prompts (LONG_PROMPTS, log-uniform, clipped to the deployment) and outputs of 1-3 budgets,
    each sent when the one before it in its chain finishes (a session's next turn that shares
    nothing of it), so that decode steps hold one or two long contexts whatever the engine's
    speed; beside them short requests, Poisson, at a rate that keeps about SHORT_RUNNING decoding
    (about 0-8 at a time), so the batch varies from 1 to ~16 and with it the decode kernel's
    partitions. The other traces compress nearly everything (98 % of their decode steps hold
    <= 1.5k entries a request on an 8B H200 calibration), which leaves the context slope to the
    longest-request term; these steps tell them apart. On a compressing deployment the long
    requests compress their outputs only (`compress_scope` "output": the prompt is pinned,
    docs/architecture.md 'Compression scope'), so their prompts stay whole. Each chain runs
    about `seconds` of engine time at the probe's speed (its step at full concurrency: small
    batches decode faster, so a little less)."""
    rng = np.random.default_rng([seed, stable_hash(name)])
    top = min(speed.prompt_cap, LONG_PROMPTS[1])
    low = min(LONG_PROMPTS[0], top)
    long_output = _long_outputs(speed, 1.0, 3.0)
    pinned = {"compress_scope": "output"} if speed.compresses else {}
    chain_cap = MAX_REQUESTS // (2 * LONG_CHAINS)  # half the trace at most: shorts fill the rest
    requests: list[TraceRequest] = []
    for chain in range(LONG_CHAINS):
        spent, previous = 0.0, None
        for turn in range(chain_cap):
            prompt_len = _clip(math.exp(rng.uniform(math.log(low), math.log(top))), 1, top)
            output_len = _clip(long_output(rng), 1, speed.max_model_len - prompt_len - 1)
            request_id = f"{name}-long{chain}-{turn}"
            follows = ({"after": previous, "prefix_len": 0} if previous is not None else {})
            requests.append(TraceRequest(id=request_id, arrival_s=0.0, prompt_len=prompt_len,
                                         output_len=output_len, session=f"{name}-chain{chain}",
                                         **follows, **pinned))
            previous = request_id
            spent += prompt_len * speed.prefill_token_s + output_len * speed.decode_step_s
            if spent >= seconds:
                break
    short = _lengths(speed, lognormal(200, 300), lognormal(120, 180),
                     output_cap=speed.kv_budget or 512)
    sample = [short(rng, -1) for _ in range(512)]
    output = float(np.mean([o for _, o, _ in sample]))
    rate = SHORT_RUNNING / (output * speed.decode_step_s)
    count = int(min(MAX_REQUESTS - len(requests),
                    max(MIN_REQUESTS - len(requests), round(rate * seconds))))
    times = np.cumsum(rng.exponential(1.0 / rate, size=count))
    for index, time in enumerate(times - times[0] if count else times):
        prompt_len, output_len, extra = short(rng, index)
        requests.append(TraceRequest(id=f"{name}-short-{index}", arrival_s=round(float(time), 6),
                                     prompt_len=prompt_len, output_len=output_len, **extra))
    return Trace(name=name, requests=requests)


def _documents(speed: EngineSpeed, documents: int = 4) -> Draw:
    """Questions about a few long documents: each prompt is a whole-block document shared with
    the other questions about it, then the question's own tokens."""
    block = speed.block_size
    length = max(block, min(3072, speed.kv_tokens // 12) // block * block)
    answer = lognormal(150, 250)

    def draw(rng: np.random.Generator, index: int) -> tuple[int, int, dict]:
        group = int(rng.integers(documents))
        prompt_len = min(speed.prompt_cap, length + int(rng.integers(16, 257)))
        shared = min(length, prompt_len)
        output_len = _clip(answer(rng), 1, speed.max_model_len - prompt_len - 1)
        return prompt_len, output_len, {"prefix_group": f"document-{group}", "prefix_len": shared}
    return draw


# ---------------------------------------------------------------- held out

def validation_trace(speed: EngineSpeed, seconds: float, seed: int = 0) -> Trace:
    """What `zipage calibrate` validates its profile on, fitted on nothing: bursts of requests
    at about the engine's capacity, prompts short or long (7 in 10 short), outputs of every
    length."""
    short, long = lognormal(200, 300), lognormal(2500, 3000)
    output = lognormal(250, 450)

    def draw(rng: np.random.Generator, index: int) -> tuple[int, int, dict]:
        prompt = short(rng) if rng.random() < 0.7 else long(rng)
        prompt_len = _clip(prompt, 1, speed.prompt_cap)
        return prompt_len, _clip(output(rng), 1, speed.max_model_len - prompt_len - 1), {}
    return sized_trace("validate-bursts", speed, seconds, 1.0, draw, seed + 7919,
                       arrivals="bursts", burst=6)


# Production shapes, from the public traces' statistics: the Azure LLM inference traces (2023),
# conversation hour (prompts median 1,020 / mean 1,155 tokens, outputs 129 / 211) and code hour
# (1,469 / 2,048, outputs 13 / 28); Mooncake's FAST'25 conversation trace (long prompts in
# 512-token hashed blocks whose leading blocks repeat as a tree).
AZURE_CONV = ((1020, 1155), (129, 211))
AZURE_CODE = ((1469, 2048), (13, 28))
CHECK_SHAPES = ("conv", "code", "overload", "bursts")


def check_traces(speed: EngineSpeed, seconds: float, seed: int, count: int = 4) -> list[Trace]:
    """`count` fresh traces for `zipage fidelity`, none of a shape or seed the calibration used:
    Azure-conversation-shaped at a busy load; Azure-code-shaped (prefill-heavy); Mooncake-shaped
    with arrivals above capacity (1.8x) and shared hashed blocks; bursts of requests with
    per-request budgets (on a compressing deployment). Beyond four, the shapes repeat with new
    seeds."""
    traces = []
    for index in range(count):
        shape = CHECK_SHAPES[index % len(CHECK_SHAPES)]
        trace_seed = seed * 1_000_003 + index
        name = f"check-{shape}" + (f"-{index // len(CHECK_SHAPES)}" if index >= 4 else "")
        if shape in ("conv", "code"):
            (prompt_median, prompt_mean), (output_median, output_mean) = (
                AZURE_CONV if shape == "conv" else AZURE_CODE)
            draw = _lengths(speed, lognormal(prompt_median, prompt_mean),
                            lognormal(output_median, output_mean))
            trace = sized_trace(name, speed, seconds, 0.75 if shape == "conv" else 0.9, draw,
                                trace_seed)
        elif shape == "overload":
            trace = _hashed_trace(name, speed, seconds, trace_seed)
        else:
            trace = _budgets(sized_trace(
                name, speed, seconds, 0.9,
                _lengths(speed, lognormal(600, 900), lognormal(400, 600)), trace_seed,
                arrivals="bursts", burst=12), speed, trace_seed)
        traces.append(trace)
    return traces


def _hashed_trace(name: str, speed: EngineSpeed, seconds: float, seed: int) -> Trace:
    """Mooncake-shaped: prompts of hashed blocks, a third extending an earlier prompt's chain
    (shared leading blocks), arrivals at 1.8x what the engine serves."""
    block = max(HASH_BLOCK_TOKENS, speed.block_size)
    prompt = lognormal(min(6000, speed.prompt_cap // 2), min(7500, speed.prompt_cap * 5 // 8))
    output = lognormal(300, 400)
    chains: list[tuple[int, ...]] = []
    fresh = iter(range(1, 1 << 40))

    def draw(rng: np.random.Generator, index: int) -> tuple[int, int, dict]:
        prompt_len = _clip(prompt(rng), 1, speed.prompt_cap)
        blocks = -(-prompt_len // block)
        hashes: tuple[int, ...] = ()
        if chains and rng.random() < 1 / 3:
            base = chains[int(rng.integers(len(chains)))]
            hashes = base[:int(rng.integers(1, len(base) + 1))][:blocks]
        hashes += tuple(next(fresh) for _ in range(blocks - len(hashes)))
        if index >= 0:  # the sizing sample shares nothing with the trace
            chains.append(hashes)
        output_len = _clip(output(rng), 1, speed.max_model_len - prompt_len - 1)
        return prompt_len, output_len, {"block_hashes": hashes, "hash_block_size": block}
    return sized_trace(name, speed, seconds, 1.8, draw, seed)


def _budgets(trace: Trace, speed: EngineSpeed, seed: int) -> Trace:
    """Each request its own KV budget (half, once or twice the deployment's), on a
    compressing deployment."""
    if speed.kv_budget is None:
        return trace
    block = speed.block_size
    choices = sorted({max(2 * block, speed.kv_budget // 2 // block * block), speed.kv_budget,
                      2 * speed.kv_budget})
    rng = np.random.default_rng([seed, stable_hash("budgets")])
    return replace(trace, requests=[replace(request, kv_budget=int(rng.choice(choices)))
                                    for request in trace.requests])
