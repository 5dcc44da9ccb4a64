"""`zipage calibrate --gpu`: time the real engine's steps and write a profile for the simulator.

The simulator's calibrated cost model (`sim/calibrated.py`, docs/cost_model.md) fits models to
measured step times: decode by (batch, context tokens), prefill by (prompts, new tokens, attention
pairs: host- or device-bound, `sim/prefill_fit.py`), mixed steps (chunked prefill: decodes and a
prompt chunk in one forward) by both, compression by source blocks, plus the slowdown of a decode
step that overlaps an async compression. This module measures exactly those on the engine: whole
`ModelRunner.execute` calls (input building on the host, the CUDA graph or eager forward,
sampling, tokens back on the host: what the step loop times), on synthetic requests laid out
directly in the block manager, so every point is exactly the batch and context it names. Nothing
here schedules; the caches hold whatever the points write (timing does not depend on the values).
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Callable

import torch

from zipage.calibration_traces import EngineSpeed
from zipage.core.deployment import ReplaySettings
from zipage.core.sampling import SamplingParams
from zipage.core.sequence import Sequence
from zipage.core.step import DECODE, MIXED, PREFILL, CompressionBatch, CompressionJob, PrefillItem, StepPlan
from zipage.decode_grid import programs_per_sm
from zipage.engine.builder import Engine, build_engine
from zipage.engine.machine import machine_record
from zipage.errors import ConfigError
from zipage.presets import model_label
from zipage.profile import DECODE_GRAPH_SIZES, DECODE_PROGRAMS_PER_SM, DECODE_SPLIT, MACHINE, PROFILE_VERSION, SETTINGS

DECODE_BATCHES = (1, 4, 16, 32, 64, 128, 256)
FULL_KV_CONTEXTS = (512, 2048, 8192)
PREFILL_TOKENS = (128, 512, 2048, 8192)
# Prompts per prefill step besides one: each short and mid-length prompt is also timed in these.
PREFILL_REQUESTS = (4, 16)
# Mixed steps: decode batches (at the smallest and largest decode context) x prompt-chunk tokens.
MIXED_BATCHES = (1, 16, 64)
MIXED_CHUNK_TOKENS = (128, 512, 2048)
# Many prompt chunks in one step (`chunk_points`): what pins the per-chunk cost where a burst of
# short prompts arrives at once (the headline's first steps hold 39-51), which runs seldom reach.
CHUNK_COUNTS = (8, 16, 32, 64)
CHUNK_STEP_TOKENS = (512, 2048)  # the chunks' tokens in all: short (host-bound) and a full step
CHUNK_DECODES = 16  # decode rows beside the chunks of a mixed step
# One short prompt alone in a step: the runs' traffic seldom holds one (their lone prompts are of
# 177 tokens and more on the 8B H200 profiles, padded to a 256-token graph), so a profile priced a
# lone 64-token prompt at its prefill floor, 25-35 % high (docs/BENCHMARKS.md, 'Quick correction
# across H200s').
SHORT_PROMPTS = (16, 64, 128)
COMPRESS_REQUESTS = (1, 2, 4, 8)
# The profile's `gpu` field names an entry of the hardware table; these substrings of the CUDA
# device name pick it when --hardware is not given.
DEVICE_NAMES = {"H200": "h200-141gb", "H100": "h100-80gb", "A100": "a100-80gb"}
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


class Bench:
    """An engine plus synthetic requests: allocate a batch, time steps on it, free it."""

    def __init__(self, engine: Engine, repeats: int) -> None:
        self.engine = engine
        self.runner = engine.runner
        self.scheduler = engine.new_scheduler()
        self.blocks = self.scheduler.block_manager
        self.config = engine.config
        self.repeats = repeats
        self.step_id = 0
        self.sequences: list[Sequence] = []

    def fits(self, *shapes: tuple[int, int]) -> bool:
        """Whether requests of these (count, tokens each) fit the free blocks and query slots."""
        block_size = self.config.block_size
        needed = sum(requests * -(-tokens_each // block_size) for requests, tokens_each in shapes)
        requests = sum(count for count, _ in shapes)
        slots_ok = not self.config.compress or requests <= self.engine.capacity.num_query_slots
        return slots_ok and needed <= self.blocks.num_free_blocks

    def make_requests(self, count: int, kv_len: int) -> list[Sequence]:
        """`count` requests holding `kv_len` cached entries each (blocks for `kv_len + 1`)."""
        block_size = self.config.block_size
        sequences = []
        needed = count * (kv_len // block_size + 1)
        if needed > self.blocks.num_free_blocks:
            raise ConfigError(f"kv_memory_gb: a calibration point needs {needed} free KV blocks, "
                              f"{self.blocks.num_free_blocks} are left; give the engine more memory")
        for index in range(count):
            seq = Sequence(f"calibrate-{len(self.sequences) + index}", None, 1 << 20,
                           prompt_len=max(kv_len, 1), sampling=GREEDY)
            seq.block_table = [self.blocks.allocate() for _ in range(kv_len // block_size + 1)]
            seq.set_counters(kv_len, 1)
            if self.config.compress:
                seq.query_slot = index
            sequences.append(seq)
        self.sequences += sequences
        return sequences

    def free(self) -> None:
        for seq in self.sequences:
            self.blocks.release_all(seq.block_table)
        self.sequences = []

    def execute(self, plan_fields: dict, sequences: list[Sequence]) -> float:
        """Wall seconds of one `execute` (it returns once the sampled tokens are on the host)."""
        self.step_id += 1
        plan = StepPlan(step_id=self.step_id, **plan_fields)
        tokens = {seq.seq_id: [1] * max(seq.kv_len + 1, seq.prompt_len) for seq in sequences}
        started = time.perf_counter()
        self.runner.execute(plan, tokens)
        return time.perf_counter() - started

    def median(self, measure: Callable[[], float]) -> float:
        measure()  # warm-up: first use of a shape compiles or autotunes kernels
        return statistics.median(measure() for _ in range(self.repeats))

    def synchronize(self) -> None:
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)


def decode_contexts(config) -> list[int]:
    """KV entries per decoding request that the decode points measure."""
    if config.compress:
        # What compressed requests hold: from one block up to N_max blocks.
        contexts = (config.block_size // 2, config.kv_budget // 2,
                    config.kv_budget + config.block_size // 2)
    else:
        contexts = FULL_KV_CONTEXTS
    return sorted({min(context, config.max_model_len - 1) for context in contexts})


def decode_points(bench: Bench, above_batch: int = 0) -> list[dict]:
    """`above_batch`: only batches larger than this (what runs through the loop did not reach)."""
    config = bench.config
    points = []
    for context in decode_contexts(config):
        for batch in DECODE_BATCHES:
            if (batch <= above_batch or batch > config.max_num_seqs
                    or not bench.fits((batch, context + 1))):
                continue
            sequences = bench.make_requests(batch, context)
            seconds = bench.median(lambda: bench.execute(dict(kind=DECODE, decode=sequences),
                                                         sequences))
            bench.free()
            points.append({"batch": batch, "context_tokens": batch * (context + 1),
                           "max_context": context + 1, "time_s": round(seconds, 9)})
    return points


def prefill_points(bench: Bench, above_tokens: int = 0) -> list[dict]:
    """`above_tokens`: only steps of more new tokens than this."""
    config = bench.config
    limit = min(config.step_tokens, config.max_model_len - 1)
    new_counts = sorted({n for n in PREFILL_TOKENS + (limit // 2,) if 16 <= n <= limit})
    if not new_counts:
        raise ConfigError(f"max_num_batched_tokens / max_model_len: a prefill of at least 16 tokens "
                          f"must fit to calibrate (the limit is {limit} tokens)")
    cases = [(1, new, cached) for new in new_counts for cached in (0, new)
             if new + cached <= config.max_model_len - 1]
    # Several prompts in one step, short (host-bound) and long (device-bound): what separates
    # the per-sequence cost from the constants (docs/cost_model.md, 'Calibrated model').
    cases += [(requests, new, 0) for requests in PREFILL_REQUESTS
              for new in sorted({new_counts[0], new_counts[len(new_counts) // 2]})]
    points = []
    for requests, new, cached in cases:
        if (requests * new <= above_tokens or requests * new > config.step_tokens
                or not bench.fits((requests, new + cached + 1))):
            continue

        def step() -> float:
            sequences = bench.make_requests(requests, 0)
            for seq in sequences:  # room for the whole prompt
                seq.block_table += [bench.blocks.allocate()
                                    for _ in range((new + cached) // config.block_size)]
                seq.prompt_len = new + cached
            items = [PrefillItem(seq, cached, cached + new) for seq in sequences]
            seconds = bench.execute(dict(kind=PREFILL, prefill=items), sequences)
            bench.free()
            return seconds

        points.append({"new_tokens": new, "cached_tokens": cached, "requests": requests,
                       "time_s": round(bench.median(step), 9)})
    return points


def chunk_request(bench: Bench, prompt_len: int, query_slot: int) -> Sequence:
    """A request whose prompt of `prompt_len` tokens has blocks, none of them computed yet."""
    seq = bench.make_requests(1, 0)[0]
    seq.block_table += [bench.blocks.allocate() for _ in range(prompt_len // bench.config.block_size)]
    seq.prompt_len = prompt_len
    if bench.config.compress:
        seq.query_slot = query_slot  # past the decode requests' slots
    return seq


def runs_mixed_steps(bench: Bench) -> str | None:
    """None if the engine executes a mixed step (decodes and a prompt chunk in one forward),
    else why not: an engine without chunked prefill rejects the plan or runs only its decodes."""
    decode = bench.make_requests(1, bench.config.block_size // 2)
    chunk = chunk_request(bench, 16, query_slot=1)
    plan = StepPlan(step_id=0, kind=MIXED, prefill=[PrefillItem(chunk, 0, 16)], decode=decode)
    tokens = {seq.seq_id: [1] * max(seq.kv_len + 1, seq.prompt_len) for seq in decode + [chunk]}
    try:
        sampled = [seq for seq, _ in bench.runner.execute(plan, tokens)]
    except Exception as error:  # noqa: BLE001 - any refusal means: no mixed points
        return f"ModelRunner.execute refused a mixed plan ({type(error).__name__}: {error})"
    finally:
        bench.free()
    if sampled != plan.sampled:
        return ("ModelRunner.execute ran a mixed plan without its prompt chunk (sampled "
                f"{len(sampled)} of {len(plan.sampled)} requests)")
    return None


def mixed_points(bench: Bench) -> list[dict]:
    """Decode batches at the smallest and largest decode context, each with the first chunk
    (nothing cached, samples nothing) or the last chunk (the first one cached, samples) of a
    prompt of two chunks."""
    config = bench.config
    contexts = decode_contexts(config)
    limit = min(config.step_tokens, (config.max_model_len - 1) // 2)
    chunk_tokens = sorted({min(new, limit) for new in MIXED_CHUNK_TOKENS})
    points = []
    for context in sorted({contexts[0], contexts[-1]}):
        for batch in MIXED_BATCHES:
            for new in chunk_tokens:
                if (batch > config.max_num_seqs or batch + new > config.step_tokens
                        or not bench.fits((batch, context + 1), (1, 2 * new + 1))):
                    continue
                for cached in (0, new):

                    def step() -> float:
                        decode = bench.make_requests(batch, context)
                        chunk = chunk_request(bench, 2 * new, query_slot=batch)
                        item = PrefillItem(chunk, cached, cached + new, samples=cached > 0)
                        seconds = bench.execute(dict(kind=MIXED, prefill=[item], decode=decode),
                                                decode + [chunk])
                        bench.free()
                        return seconds

                    points.append({"batch": batch, "context_tokens": batch * (context + 1),
                                   "new_tokens": new, "cached_tokens": cached, "requests": 1,
                                   "time_s": round(bench.median(step), 9)})
    return points


def chunk_points(bench: Bench, above_prefill: int = 0, above_mixed: int | None = 0
                 ) -> tuple[list[dict], list[dict]]:
    """Prefill steps of CHUNK_COUNTS whole prompts sharing CHUNK_STEP_TOKENS, and mixed steps of
    as many prompts beside CHUNK_DECODES decodes at the smallest decode context: only counts
    above `above_prefill` / `above_mixed` (what runs through the loop held; None: no mixed
    points, the engine runs none). A step the pool, the query slots or the step's token limit
    cannot hold is skipped."""
    config = bench.config
    context = decode_contexts(config)[0]
    longest = config.max_model_len - 1  # one prompt's tokens at most
    prefill, mixed, seen = [], [], set()
    for count in CHUNK_COUNTS:
        for total in CHUNK_STEP_TOKENS:
            new = min(min(total, config.step_tokens) // count, longest)
            if (count > above_prefill and new >= 16 and ("prefill", count, new) not in seen
                    and bench.fits((count, new + 1))):
                seen.add(("prefill", count, new))
                prefill.append({"new_tokens": new, "cached_tokens": 0, "requests": count,
                                "time_s": round(bench.median(lambda: _chunks_step(
                                    bench, count, new)), 9)})
            decodes = min(CHUNK_DECODES, config.max_num_seqs - count)
            new = min(min(total, config.step_tokens - decodes) // count, longest)
            if (above_mixed is not None and count > above_mixed and decodes >= 1 and new >= 16
                    and ("mixed", count, new) not in seen
                    and bench.fits((decodes, context + 1), (count, new + 1))):
                seen.add(("mixed", count, new))
                mixed.append({"batch": decodes, "context_tokens": decodes * (context + 1),
                              "new_tokens": new, "cached_tokens": 0, "requests": count,
                              "time_s": round(bench.median(lambda: _chunks_step(
                                  bench, count, new, decodes, context)), 9)})
    return prefill, mixed


def short_prompt_points(bench: Bench, below_tokens: float = float("inf")) -> list[dict]:
    """Prefill steps of one whole prompt of each SHORT_PROMPTS length under `below_tokens` (the
    shortest whole prompt a run's step held alone) that the pool and the step's limit hold."""
    config = bench.config
    points = []
    for new in SHORT_PROMPTS:
        if new < below_tokens and new <= min(config.step_tokens, config.max_model_len - 1) \
                and bench.fits((1, new + 1)):
            points.append({"new_tokens": new, "cached_tokens": 0, "requests": 1,
                           "time_s": round(bench.median(lambda: _chunks_step(bench, 1, new)), 9)})
    return points


def _chunks_step(bench: Bench, count: int, new: int, decodes: int = 0, context: int = 0) -> float:
    """One step of `count` whole prompts of `new` tokens (beside `decodes` requests decoding at
    `context` entries: a mixed step); its wall seconds."""
    decode = bench.make_requests(decodes, context) if decodes else []
    chunks = [chunk_request(bench, new, query_slot=decodes + index) for index in range(count)]
    items = [PrefillItem(seq, 0, new) for seq in chunks]
    plan = (dict(kind=MIXED, prefill=items, decode=decode) if decodes
            else dict(kind=PREFILL, prefill=items))
    seconds = bench.execute(plan, decode + chunks)
    bench.free()
    return seconds


def compression_jobs(bench: Bench, requests: int, blocks_each: int) -> list[CompressionJob]:
    """Requests at their trigger: `blocks_each` full blocks, targets their own first N_max - 1."""
    n_max = bench.config.n_max
    sequences = bench.make_requests(requests, blocks_each * bench.config.block_size - 1)
    return [CompressionJob(seq=seq, source_table=seq.block_table[:blocks_each],
                           target_blocks=seq.block_table[:n_max - 1],
                           new_block=seq.block_table[n_max - 1],
                           released=seq.block_table[n_max:blocks_each],
                           query_slot=seq.query_slot, is_first=blocks_each > n_max)
            for seq in sequences]


def compress_points(bench: Bench) -> list[dict]:
    n_max = bench.config.n_max
    points = []
    for requests in COMPRESS_REQUESTS:
        for blocks_each in (n_max, 2 * n_max):
            if not bench.fits((requests, blocks_each * bench.config.block_size)):
                continue
            jobs = compression_jobs(bench, requests, blocks_each)

            def batch() -> float:
                bench.synchronize()
                started = time.perf_counter()
                bench.runner.compressor.run(jobs)
                bench.synchronize()
                return time.perf_counter() - started

            seconds = bench.median(batch)
            bench.free()
            points.append({"requests": requests, "blocks": requests * blocks_each,
                           "blocks_squared": requests * blocks_each ** 2,
                           "time_s": round(seconds, 9)})
    return points


def contention_factor(bench: Bench, compress: list[dict]) -> float | None:
    """The simulator's multiplier for a decode step that fully overlaps an async compression.

    Decode steps of a mid-size batch alone, then with a batch of two requests launched on the
    compressor's stream in the first of them, stepping until it reports done: the extra time of
    those steps over the same number alone, per second of overlap (the compression's own
    duration, or the time of the steps it overlapped if shorter: the steps after the launching
    one, which it runs behind, unless it finished within that one), plus one. 1.0 would be a
    free overlap; 2.0 a compression that delays the decode by all of its own time.
    """
    config = bench.config
    pair = next((p for p in compress if p["requests"] == 2 and p["blocks"] == 2 * config.n_max),
                None)
    batch = next((b for b in (64, 32, 16, 4) if b <= config.max_num_seqs
                  and bench.fits((b + 2, config.n_max * config.block_size))), None)
    if pair is None or batch is None:
        return None
    compressor = bench.runner.compressor
    sequences = bench.make_requests(batch, config.kv_budget - 1)
    decode = dict(kind=DECODE, decode=sequences)
    alone = bench.median(lambda: bench.execute(decode, sequences))
    jobs = compression_jobs(bench, 2, config.n_max)
    for job, slot in zip(jobs, range(batch, batch + 2)):
        job.seq.query_slot = slot
        job.query_slot = slot
    ratios = []
    for attempt in range(bench.repeats):
        bench.synchronize()
        steps = [bench.execute(dict(decode, compress_launch=CompressionBatch(
            batch_id=attempt, jobs=jobs)), sequences)]
        while not compressor.completed():
            steps.append(bench.execute(decode, sequences))
        behind = len(steps) > 1
        overlapped = len(steps) - 1 if behind else len(steps)
        overlap = min(pair["time_s"], overlapped * alone)
        ratios.append(1.0 + max(0.0, sum(steps) - len(steps) * alone) / overlap)
    bench.free()
    return round(statistics.median(ratios), 3)


def probe_speed(bench: Bench) -> EngineSpeed:
    """How fast this engine decodes and prefills, and what it holds: the few measurements that
    size the calibration and checking traces in seconds (zipage/calibration_traces.py). A decode
    step at the most requests that run at once (of a compressed request's context, or 1,024
    entries), and a prefill of up to 2,048 tokens."""
    config, capacity = bench.config, bench.engine.capacity
    concurrency = min(config.max_num_seqs, capacity.num_query_slots) if config.compress \
        else config.max_num_seqs
    context = min(config.kv_budget if config.compress else 1024, config.max_model_len - 1)
    batch = max(1, concurrency)
    while batch > 1 and not bench.fits((batch, context + 1)):
        batch //= 2
    sequences = bench.make_requests(batch, context)
    decode = bench.median(lambda: bench.execute(dict(kind=DECODE, decode=sequences), sequences))
    bench.free()
    tokens = max(16, min(2048, config.step_tokens, config.max_model_len - 1))

    def prefill() -> float:
        seq = bench.make_requests(1, 0)[0]
        seq.block_table += [bench.blocks.allocate() for _ in range(tokens // config.block_size)]
        seq.prompt_len = tokens
        seconds = bench.execute(dict(kind=PREFILL, prefill=[PrefillItem(seq, 0, tokens)]), [seq])
        bench.free()
        return seconds

    return EngineSpeed(
        decode_step_s=decode, prefill_token_s=bench.median(prefill) / tokens,
        concurrency=concurrency, kv_tokens=capacity.num_blocks * config.block_size,
        max_model_len=config.max_model_len, block_size=config.block_size,
        kv_budget=config.kv_budget if config.compress else None,
        step_tokens=config.step_tokens)


def hardware_name(hardware: str | None, device: torch.device) -> str:
    """The hardware-table entry the profile is for: `hardware` if given, else the CUDA device's."""
    if hardware:
        from zipage.hardware import get_hardware

        return get_hardware(hardware).name  # refuses an unknown name, listing the known ones
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, hardware in DEVICE_NAMES.items():
            if key in name:
                return hardware
        raise ConfigError(f"hardware: {name!r} is not in the hardware table; pass --hardware "
                          "with the closest entry (a100-80gb, h100-80gb, h200-141gb)")
    raise ConfigError("hardware: a CPU calibration must name the GPU entry its profile stands "
                      "for; pass --hardware (e.g. h200-141gb)")


def calibrate(settings: ReplaySettings, device: str | None = None, *, hardware: str | None = None,
              repeats: int = 5, progress: bool = False, cuda_graphs: bool = True,
              prefill_graphs: bool | None = None) -> dict:
    """Measure the engine built from `settings` (graphs as `build_engine` takes them) and return
    a profile (docs/cost_model.md)."""
    if repeats < 1:
        raise ConfigError(f"repeats: got {repeats}, expected >= 1")
    engine_device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = hardware_name(hardware, engine_device)  # before the slow part: refuse a bad label first
    engine = build_engine(settings, device, cuda_graphs, prefill_graphs)
    try:  # tensor parallel: every rank runs each timed step (the executor has the runner's calls)
        return _measure(engine, Bench(engine, repeats), settings, gpu, repeats, progress)
    finally:
        engine.close()


def _measure(engine: Engine, bench: Bench, settings: ReplaySettings, gpu: str, repeats: int,
             progress: bool) -> dict:
    config = engine.config
    sections = [("decode", decode_points), ("prefill", prefill_points)]
    no_mixed = runs_mixed_steps(bench)
    if no_mixed is None:
        sections.append(("mixed", mixed_points))
    if config.compress:
        sections.append(("compress", compress_points))
    report = print if progress else (lambda *args, **kwargs: None)
    note = (f"measured by `zipage calibrate` on {_device_name(engine.device)}, torch "
            f"{torch.__version__}, {datetime.date.today().isoformat()}, {repeats} repeats "
            f"(median); whole engine steps, host work included")
    if no_mixed is not None:
        report(f"mixed: no points: {no_mixed}", flush=True)
        note += f"; no mixed points: {no_mixed}"
    profile = {
        "version": PROFILE_VERSION,
        "note": note,
        "source": "measured",
        "model": model_label(engine.shape.name),
        "gpu": gpu,
        "dtype": settings.dtype,
        **config.cost_knobs(),
        "tensor_parallel": settings.tensor_parallel,
        "graphs": engine.runner.graphed_steps,  # a graphed step costs less host time
    }
    if engine.runner.prefill_buckets:
        # Steps up to the largest bucket computed their bucket's rows: the fits price them so.
        profile["prefill_buckets"] = list(engine.runner.prefill_buckets)
    if engine.runner.decode_graph_sizes:  # decode steps computed their graph's padded rows
        profile[DECODE_GRAPH_SIZES] = engine.runner.decode_graph_sizes
    profile[DECODE_PROGRAMS_PER_SM] = programs_per_sm(config.kv_cache_dtype)  # the grid its kernel ran
    profile[DECODE_SPLIT] = "rule"  # and how it split the rows
    for name, measure in sections:
        started = time.perf_counter()
        profile[name] = measure(bench)
        report(f"{name}: {len(profile[name])} points in {time.perf_counter() - started:.1f} s",
               flush=True)
    if config.compress:
        factor = contention_factor(bench, profile["compress"])
        if factor is not None:
            profile["contention_factor"] = factor
            report(f"contention factor: {factor}", flush=True)
    # Where and how it was measured: what `zipage calibrate --quick` checks and rebuilds.
    profile[MACHINE] = machine_record(engine.device)
    profile[SETTINGS] = settings.to_dict()
    return profile


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
