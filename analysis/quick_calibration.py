"""`zipage calibrate --quick`: re-scale a profile measured on another machine of this kind from a
few anchor steps run here (docs/cost_model.md, 'Quick correction').

The anchors are four bursts run through the engine loop exactly as `zipage replay --gpu` runs a
trace (so each step is what a profile's point is: a loop step, host work and the gap to the next
step included): one request, then 16 and 64 requests of a short prompt, then 16 of a long one,
every request of a burst arriving at once and decoding OUTPUT_TOKENS tokens. Each burst's steps
of one kind (its prompt steps, the mixed steps of chunked prefill, its decode steps) make one
anchor: from one request's decode (the host's floor and the weights' read) to long prompt chunks
(the GPU's FLOPs). With compression on, every prompt and output stays within the budget, so no
request is compressed: the anchors time forwards, which is what a correction can re-scale. A
warm-up pass compiles what the bursts meet, then PASSES measured passes; the profile prices
every measured step (`CalibratedCostModel`), and sim/quick_correction.py fits the scales and
judges them.
"""

from __future__ import annotations

import datetime
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from zipage.analysis.calibration import STALL_FACTOR, Twin, run_engine, runs_directory
from zipage.core.memory import MemoryPlan
from zipage.dtypes import DTYPE_BYTES
from zipage.engine.machine import machine_record, same_kind
from zipage.errors import ConfigError
from zipage.hardware import get_hardware
from zipage.presets import model_identity
from zipage.profile import MACHINE, SETTINGS, VALIDATION, read_profile, read_record
from zipage.sim.calibrated import CalibratedCostModel
from zipage.sim.profile_from_runs import forward_points
from zipage.sim.quick_correction import (
    GROUPS,
    MAX_RESIDUAL,
    MAX_SCALE,
    Anchor,
    Correction,
    apply_correction,
    fit_correction,
    point_work,
    roofline_model,
    scale_text,
    step_shares,
)
from zipage.trace import Trace, TraceRequest

# Tokens each anchor request generates: that many decode steps per burst, enough for a median
# that one slow step does not move (a Qwen3-8B burst of 64 decodes in about 0.4 s on an H200).
OUTPUT_TOKENS = 48
# Measured passes over the bursts after the warm-up: a burst's single prompt step is an anchor of
# PASSES points.
PASSES = 3
# An anchor needs this many steps; a kind a burst ran fewer of (a mixed step or two at the end of
# a prefill) says too little to weigh against the others.
MIN_POINTS = 3
# The bursts, as (name, requests, prompt): a short prompt is SHORT_PROMPT tokens (or a quarter of
# the longest one the setup allows), a long one the longest, at most LONG_PROMPT.
SHORT_PROMPT, LONG_PROMPT = 64, 2048
BURSTS = (("single", 1, "short"), ("batch16", 16, "short"), ("batch64", 64, "short"),
          ("long16", 16, "long"))
# A burst's requests take at most this share of the KV blocks (each needs a block beyond its
# tokens while it decodes; the rest is slack for the scheduler's watermark).
BLOCK_SHARE = 0.8

Report = Callable[[str], None]


@dataclass(frozen=True)
class Burst:
    """Requests that arrive at once, each of `prompt_len` tokens generating `output_len`."""

    name: str
    requests: int
    prompt_len: int
    output_len: int

    def trace(self, tag: str) -> Trace:
        return Trace(f"quick-{self.name}-{tag}", [
            TraceRequest(id=f"{self.name}-{tag}-{index}", arrival_s=0.0,
                         prompt_len=self.prompt_len, output_len=self.output_len)
            for index in range(self.requests)])


def anchor_plan(config, capacity: MemoryPlan) -> list[Burst]:
    """The bursts this engine can run (the budget, the longest request, the KV blocks and the
    requests that run at once bound them); a burst that would repeat another is left out."""
    limit = config.max_model_len - 1
    if config.compress:
        limit = min(limit, config.kv_budget)  # never compressed: a correction times forwards
    output = max(1, min(OUTPUT_TOKENS, limit // 2))
    longest = limit - output
    prompts = {"short": max(1, min(SHORT_PROMPT, longest // 4)),
               "long": max(1, min(LONG_PROMPT, longest))}
    concurrency = config.max_num_seqs
    if config.compress:
        concurrency = min(concurrency, capacity.num_query_slots)
    bursts, seen = [], set()
    for name, requests, length in BURSTS:
        prompt = prompts[length]
        blocks_each = -(-(prompt + output + 1) // config.block_size)
        fits = int(BLOCK_SHARE * capacity.num_blocks // blocks_each)
        requests = max(1, min(requests, concurrency, fits))
        if (requests, prompt) not in seen:
            seen.add((requests, prompt))
            bursts.append(Burst(name, requests, prompt, output))
    return bursts


@dataclass
class QuickResult:
    """What `quick_correct` found: the correction (refused or not), the corrected profile where
    it stands, and how long the anchors took."""

    correction: Correction
    profile: dict | None
    bursts: list[Burst]
    elapsed_s: float


def check_profile(twin: Twin, path: str | Path) -> tuple[dict, CalibratedCostModel, dict]:
    """The profile's data, its model for this engine's setup, and this machine's record; a
    profile of another setup or another kind of machine is refused (ConfigError, one line)."""
    source, data = read_profile(path)
    engine, settings = twin.engine, twin.settings
    knobs = {"dtype_bytes": DTYPE_BYTES[settings.dtype], **engine.config.cost_knobs(),
             "tensor_parallel": settings.tensor_parallel}
    model = CalibratedCostModel.from_profile(path, shape=engine.shape, gpu=get_hardware(twin.gpu),
                                             **knobs)
    ours = machine_record(engine.device)
    differs = same_kind(ours, read_record(source, data, MACHINE))
    fix = "measure a profile on this machine with `zipage calibrate` (the full calibration)"
    if differs:
        raise ConfigError(f"--profile: {source}: {differs}; a quick correction re-scales a "
                          f"profile between machines of one kind; {fix}")
    recorded = read_record(source, data, SETTINGS)
    if recorded is not None:
        differences = settings_differences(recorded, settings.to_dict())
        if differences:
            raise ConfigError(f"--profile: {source}: measured with {', '.join(differences)}; "
                              "pass the same flags (the profile's `settings` has them all)")
    elif ("compress" in data) != engine.config.compress:
        # A profile without the record says compression only by its compress section: the
        # shipped Full KV profiles have none, the Zipage ones do.
        compressed = "compress" in data
        raise ConfigError(f"--profile: {source}: {'has' if compressed else 'has no'} compress "
                          f"section (measured with compression {'on' if compressed else 'off'}), "
                          f"this engine runs with it {'on' if engine.config.compress else 'off'}; "
                          f"{'drop' if compressed else 'pass'} --no-compress")
    return data, model, ours


# The deployment fields a step's cost depends on beyond the header's knobs: the memory (how many
# blocks and query slots, so which batches run) and the step's token limit.
SETTING_FIELDS = ("model", "dtype", "kv_memory_gb", "tensor_parallel")
CONFIG_FIELDS = ("compress", "max_num_seqs", "max_num_batched_tokens", "chunked_prefill",
                 "async_compress")


def settings_differences(recorded: dict, ours: dict) -> list[str]:
    """'FIELD VALUE (this run: VALUE)' for each field of SETTING_FIELDS and CONFIG_FIELDS the
    profile's recorded settings give another value than this run's."""
    differences = []
    for name in SETTING_FIELDS:
        theirs, mine = recorded.get(name), ours.get(name)
        if name == "model" and theirs is not None:
            same = model_identity(str(theirs)) == model_identity(str(mine))
        elif isinstance(theirs, float) or isinstance(mine, float):
            same = theirs is not None and mine is not None \
                and abs(float(theirs) - float(mine)) <= 1e-9 * max(abs(float(theirs)), 1.0)
        else:
            same = theirs is None or theirs == mine
        if not same:
            differences.append(f"{name} {theirs!r} (this run: {mine!r})")
    config_theirs, config_mine = recorded.get("config") or {}, ours.get("config") or {}
    for name in CONFIG_FIELDS:
        if name in config_theirs and config_theirs[name] != config_mine.get(name):
            differences.append(f"{name} {config_theirs[name]!r} (this run: "
                               f"{config_mine.get(name)!r})")
    return differences


def quick_correct(twin: Twin, path: str | Path, *, max_residual: float = MAX_RESIDUAL,
                  max_scale: float = MAX_SCALE, runs_dir: str | Path | None = None,
                  report: Report = print) -> QuickResult:
    """Run the anchors on `twin`'s engine, fit the correction of the profile at `path` and, where
    it stands, return the corrected profile (not written: the caller writes it)."""
    started = time.perf_counter()
    data, model, ours = check_profile(twin, path)
    bursts = anchor_plan(twin.engine.config, twin.engine.capacity)
    kinds = 3 if twin.engine.config.chunked_prefill else 2
    shapes = ", ".join(f"{burst.name}: {burst.requests} x {burst.prompt_len}+{burst.output_len}"
                       for burst in bursts)
    report(f"{len(bursts)} bursts ({shapes} tokens), up to {kinds * len(bursts)} anchors (each "
           f"burst's prefill, {'mixed, ' if kinds == 3 else ''}decode steps); a warm-up pass, "
           f"then {PASSES} measured")
    roofline = roofline_model(model.header, twin.engine.shape)
    with runs_directory(runs_dir) as root:
        runs = run_anchors(twin, bursts, root)
        anchors = [anchor for burst in bursts
                   for anchor in burst_anchors(burst, runs[burst.name], model, roofline)]
    correction = fit_correction(anchors, max_residual=max_residual, max_scale=max_scale)
    elapsed = time.perf_counter() - started
    if correction.refusal is not None:
        return QuickResult(correction, None, bursts, elapsed)
    record = {**correction.record(), "source": str(path),
              "source_machine": data.get(MACHINE), "machine": ours,
              "date": datetime.date.today().isoformat(), "anchor_seconds": round(elapsed, 1)}
    return QuickResult(correction, corrected_profile(data, correction, roofline, record), bursts,
                       elapsed)


def run_anchors(twin: Twin, bursts: list[Burst], root: Path) -> dict[str, list[Path]]:
    """Each burst through the engine loop: once to warm up (compiles what the bursts meet;
    discarded), then PASSES times; the measured runs' directories by burst."""
    for burst in bursts:
        run_engine(twin, burst.trace("warm-up"), twin.settings, root / f"{burst.name}-warm-up",
                   False, _quiet)
    return {burst.name: [run_engine(twin, burst.trace(f"pass{index}"), twin.settings,
                                    root / f"{burst.name}-pass{index}", False, _quiet)
                         for index in range(PASSES)] for burst in bursts}


def corrected_profile(data: dict, correction: Correction, roofline, record: dict) -> dict:
    """`data` re-scaled by `correction`, with `record` as its correction, this machine as its
    machine, the note saying so, and a warning in its validation that the band was measured
    before the correction, on the other machine."""
    corrected = apply_correction(data, correction, roofline, record)
    ours = record["machine"]
    corrected[MACHINE] = ours
    corrected["note"] = (f"{data.get('note', '')}; re-scaled by `zipage calibrate --quick` on "
                         f"{ours.get('gpu_name', ours['device'])}, {record['date']} "
                         f"({scale_text(correction.scales)})").lstrip("; ")
    validation = corrected.get(VALIDATION)
    if isinstance(validation, dict):
        warnings = list(validation.get("warnings") or [])
        warnings.append("validated on the machine the profile was measured on, before its quick "
                        "correction to this one")
        warnings += [f"misprices '{anchor.name}' by {residual:+.1%} after its quick correction "
                     "(an anchor the correction left out)" for anchor, residual in correction.left_out]
        corrected[VALIDATION] = {**validation, "warnings": warnings}
    return corrected


def burst_anchors(burst: Burst, run_dirs: list[Path], model: CalibratedCostModel,
                  roofline) -> list[Anchor]:
    """One anchor per kind of step the burst's measured runs hold at least MIN_POINTS of."""
    points = forward_points(run_dirs, stall_factor=STALL_FACTOR)
    anchors = []
    for kind in ("prefill", "mixed", "decode"):
        rows = points[kind]
        if len(rows) < MIN_POINTS:
            continue
        works = [point_work(kind, row) for row in rows]
        predicted = [model.forward_time_for(work) for work in works]
        measured = [row["time_s"] for row in rows]
        shares = [step_shares(roofline, work, seconds) for work, seconds in zip(works, predicted)]
        mean_shares = tuple(statistics.fmean(share[index] for share in shares)
                            for index in range(len(GROUPS)))
        anchors.append(Anchor(
            name=f"{burst.name} {kind}", kind=kind, points=len(rows),
            measured_s=statistics.median(measured), predicted_s=statistics.median(predicted),
            ratio=statistics.median(m / p for m, p in zip(measured, predicted)),
            shares=mean_shares))
    return anchors


def anchor_table(correction: Correction) -> str:
    """One line per anchor: its steps, median measured and predicted times, ratio, shares and
    what the fitted scales leave of it."""
    lines = [f"{'anchor':<18} {'steps':>5} {'here ms':>9} {'profile ms':>10} {'ratio':>6} "
             f"{'host':>5} {'mem':>5} {'comp':>5} {'resid':>7}"]
    rows = [(anchor, residual, "") for anchor, residual in zip(correction.anchors,
                                                                 correction.residuals)]
    rows += [(anchor, residual, "  left out") for anchor, residual in correction.left_out]
    for anchor, residual, mark in rows:
        host, memory, compute = anchor.shares
        lines.append(f"{anchor.name:<18} {anchor.points:>5} {anchor.measured_s * 1e3:>9.3f} "
                     f"{anchor.predicted_s * 1e3:>10.3f} {anchor.ratio:>6.3f} {host:>5.2f} "
                     f"{memory:>5.2f} {compute:>5.2f} {residual:>+7.1%}{mark}")
    considered = ", ".join(f"{name} {'-' if rms is None else f'{rms:.1%}'}"
                           for name, rms in correction.considered.items())
    lines.append(f"scales ({correction.model}): {scale_text(correction.scales)}; worst anchor "
                 f"{correction.worst:.1%} off; RMS residual by model: {considered} "
                 "('-': the anchors cannot tell its groups apart)")
    for anchor, residual in correction.left_out:
        lines.append(f"left out: '{anchor.name}', {residual:+.1%} off the scaled profile while "
                     "the rest agree: the profile's shape there, not this machine's speed (it "
                     "misprices that step on its own machine too; a full `zipage calibrate` "
                     "measures it)")
    return "\n".join(lines)


def _quiet(line: str) -> None:
    pass


def describe(result: QuickResult) -> dict[str, Any]:
    """The JSON-able summary of a quick correction (for logs and the bench)."""
    return {"model": result.correction.model, "scales": result.correction.scales,
            "worst_residual": result.correction.worst, "refusal": result.correction.refusal,
            "anchors": [anchor.record() for anchor in result.correction.anchors],
            "left_out": [dict(anchor.record(), residual=residual)
                         for anchor, residual in result.correction.left_out],
            "elapsed_s": result.elapsed_s}
