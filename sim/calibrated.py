"""The calibrated cost model: simple linear models fitted to a profile measured on a real GPU.

The profile is read and checked by `zipage.profile`; its sections are fitted here (decode and
compression), in sim/prefill_fit.py and in sim/mixed_fit.py. It is as good as the profile, and
only for the setup measured (the header says which; a run with another is refused). Formats and
fits: docs/cost_model.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from zipage.core.memory import heads_per_gpu
from zipage.decode_grid import (
    PROGRAMS_PER_SM,
    balanced_row_partitions,
    decode_grid_partitions,
    decode_num_partitions,
    graph_batch,
)
from zipage.errors import ConfigError, UnknownModelError
from zipage.hardware import GPUSpec, get_hardware
from zipage.presets import get_preset
from zipage.profile import (
    CORRECTION,
    DECODE_EXCESS,
    DECODE_GRAPH_SIZES,
    DECODE_PROGRAMS_PER_SM,
    DECODE_SPLIT,
    MACHINE,
    PER_ENTRY,
    PER_PARTITION,
    Validation,
    check_header,
    read_points,
    read_profile,
    read_record,
    read_validation,
)
from zipage.scoring import DEFAULT_SCORING, SCORING_POLICIES
from zipage.shape import ModelShape
from zipage.sim.analytic import DEFAULT_CONTENTION, AnalyticCostModel
from zipage.sim.cost_model import CostModel, StepWork
from zipage.sim.decode_host import fit_host_floor
from zipage.sim.linear_fit import LinearFit, fit_linear
from zipage.sim.mixed_fit import MixedFit, fit_mixed_points
from zipage.sim.prefill_fit import PREFILL_DEFAULTS, PrefillFit, fit_prefill_points, padded_tokens


class CalibratedCostModel(CostModel):
    """Linear models fitted to a measured profile (format and fits: docs/cost_model.md).

    decode:   a + b * batch + c * context_tokens [+ d * longest_excess, when the points carry
              max_context: the longest request's entries beyond the mean, max - sum / batch;
              with the header's decode_excess "per_partition" that excess over the split-K
              kernel's partitions at the batch, d * partition_excess]
              [+ e * shared_tokens, e < 0, when points share prefix blocks: an entry read by a
              second request in the same step costs c + e, not c]; that line under a host
              floor, max(h_d, line), where the points determine one (sim/decode_host.py).
              With the header's decode_graph_sizes, batch (and the batch the partitions are
              counted at) is the captured graph's padded size, `DecodeRows`; the excess is
              still over the live requests' mean
    launch:   a decode step that launches an async compression batch lasts max(h_l, forward +
              x_l): the host enqueues the batch's kernels behind the forward (a floor), and the
              batch's first kernels start beside the forward's last ones (an extra), when the
              profile has launch points
    prefill:  s * requests + max(h, a + b * new_tokens + c * attention_pairs)   (version 3;
              before it s = h = 0; pairs: sum of T*C + T(T+1)/2)
    mixed:    s * requests + max(h_m, m + decode's b, c terms + prefill's b, c terms)
              (m and, version 3, h_m fitted to the mixed points; h_m = h when they cannot
              determine it)
    A profile with `prefill_buckets` measured an engine that pads prefill and mixed steps of
    up to its largest bucket to the next bucket (its prefill graphs): there new_tokens is the
    padded row count less the decode rows, in the fits and in the predictions alike.
    compress: a + b * blocks [+ c * blocks_squared with the flash redundancy score], for the
              scoring policy the profile measured; a request with another policy of its own
              (`Sequence.scoring`) costs that times the analytic model's ratio of its policy to
              the measured one on the same jobs (the profile scales the analytic cost of its
              policy; the other policy's is assumed scaled alike)
    """

    def __init__(self, decode: LinearFit, prefill: PrefillFit, mixed: MixedFit,
                 compress: LinearFit | None, contention_factor: float, header: dict[str, Any],
                 source: str, validation: Validation | None = None,
                 launch_floor_s: float = 0.0, launch_extra_s: float = 0.0,
                 partitions: DecodePartitions | None = None,
                 rows: DecodeRows | None = None) -> None:
        self.decode_fit, self.prefill_fit, self.mixed_fit = decode, prefill, mixed
        self.compress_fit = compress
        self.contention_factor = contention_factor
        self.launch_floor_s, self.launch_extra_s = launch_floor_s, launch_extra_s
        self.header, self.source = header, source
        # The policy its compressions were measured with (a profile from before the knob: the
        # default's); `from_profile` refuses a deployment of another.
        self.scoring = header.get("scoring", DEFAULT_SCORING)
        self.validation = validation
        self.machine: dict | None = None
        self.correction: dict | None = None
        # The run's model, GPU and knobs where the profile is loaded for a run (else None), and
        # the analytic model built from them when a request first brings another scoring policy.
        self.run_setup: tuple[ModelShape, GPUSpec, dict[str, Any]] | None = None
        self.analytic: AnalyticCostModel | None = None
        self.measured_graphs = header.get("graphs")
        self.prefill_buckets = tuple(header.get("prefill_buckets") or ())
        self._decode_a, self._decode_b, self._decode_c = decode.coefficients[:3]
        terms = dict(zip(decode.feature_names, decode.coefficients))
        # Per KV entry the longest request holds beyond the mean (per entry of its partition,
        # where `partitions` is given: the profile's decode_excess is "per_partition"), and per
        # entry a second holder reads of a shared block (0 when not fitted).
        self._decode_excess = terms.get(LONGEST_EXCESS, terms.get(PARTITION_EXCESS, 0.0))
        self.decode_partitions = partitions
        self.decode_rows = rows or DecodeRows(())
        self.decode_graph_sizes = self.decode_rows.sizes
        self._decode_shared = terms.get(SHARED_TOKENS, 0.0)
        # A host-bound decode step (sim/decode_host.py) costs at least the host's time.
        self._decode_floor = max(decode.floor_s, getattr(decode, "host_s", 0.0))

    @classmethod
    def from_profile(cls, profile: str | Path | dict, *, shape: ModelShape | None = None,
                     gpu: GPUSpec | None = None, **knobs: Any) -> "CalibratedCostModel":
        """Fit a profile (a path or an already-parsed dict); check it matches the run if given."""
        source, data = read_profile(profile)
        header = check_header(source, data, shape, gpu, knobs)
        validation = read_validation(source, data)
        # A profile from before the scoring knob measured the default pipeline: its compression
        # fit prices no other policy.
        scoring = header.get("scoring", DEFAULT_SCORING)
        if scoring not in SCORING_POLICIES:
            raise ConfigError(f"{source}: scoring: got {scoring!r}, expected one of "
                              f"{', '.join(SCORING_POLICIES)}")
        if knobs.get("scoring", scoring) != scoring:
            raise ConfigError(f"{source}: scoring: measured with {scoring!r}, but this run uses "
                              f"{knobs['scoring']!r}; measure a profile for this setup, or use "
                              "--cost-model analytic")
        # The redundancy the measured policy ran: the knob's, or the policy's own.
        redundancy = (SCORING_POLICIES[scoring].cost.redundancy
                      or header.get("redundancy", "lightning"))
        decode_rows = read_points(source, data, "decode", ("batch", "context_tokens"),
                                  DECODE_DEFAULTS)
        partitions = (decode_partitions(source, header)
                      if header.get(DECODE_EXCESS, PER_ENTRY) == PER_PARTITION else None)
        rows = DecodeRows(tuple(header.get(DECODE_GRAPH_SIZES) or ()))
        decode = _decode_fit(source, decode_rows, partitions, rows)
        prefill_rows = read_points(source, data, "prefill", ("new_tokens",), PREFILL_DEFAULTS)
        buckets = tuple(header.get("prefill_buckets") or ())
        prefill = fit_prefill_points(source, data["version"], prefill_rows, buckets)
        mixed_rows = []
        if "mixed" in data:
            # The longest decode row too: the fit must see the `longest_decode` the simulator
            # prices a step with, not the mean context it falls back to without it.
            mixed_rows = read_points(source, data, "mixed",
                                     ("batch", "context_tokens", "new_tokens"),
                                     {**PREFILL_DEFAULTS, "max_context": None})
        mixed = fit_mixed_points(source, data["version"], decode, prefill, mixed_rows, buckets)
        compress = None
        if "compress" in data:
            compress_rows = read_points(source, data, "compress", ("requests", "blocks"),
                                        {"blocks_squared": None})
            times = [row["time_s"] for row in compress_rows]
            if redundancy == "flash":
                compress = fit_linear(source, "compress", ("blocks", "blocks_squared"),
                                      [[row["blocks"], _blocks_squared(row)]
                                       for row in compress_rows],
                                      times, proportional_if_uniform=True)
            else:
                compress = fit_linear(source, "compress", ("blocks",),
                                      [[row["blocks"]] for row in compress_rows], times,
                                      proportional_if_uniform=True)
        contention = knobs.get("contention_factor")
        if contention is None:
            contention = data.get("contention_factor", DEFAULT_CONTENTION[redundancy])
        if isinstance(contention, bool) or not isinstance(contention, (int, float)) \
                or not contention >= 1.0:
            raise ConfigError(f"{source}: contention_factor: got {contention!r}, "
                              "expected a number >= 1")
        model = cls(decode, prefill, mixed, compress, float(contention), header, source,
                    validation, partitions=partitions, rows=rows)
        model.decode_programs_per_sm = measured_grid(header)
        model.decode_split = header.get(DECODE_SPLIT, "batch")
        if shape is not None and gpu is not None:
            model.run_setup = (shape, gpu, {**knobs, "scoring": scoring})
        # Where it was measured and how it was re-scaled since (None: not recorded); they change
        # no prediction (the points were re-scaled), so they are only carried.
        model.machine = read_record(source, data, MACHINE)
        model.correction = read_record(source, data, CORRECTION)
        if "launch" in data:
            launch_rows = read_points(source, data, "launch", ("batch", "context_tokens"),
                                      DECODE_DEFAULTS)
            model.launch_floor_s, model.launch_extra_s = fit_launch(
                [(model.forward_time_for(_decode_work(row)), row["time_s"])
                 for row in launch_rows])
        return model

    def step_time(self, plan) -> float:
        duration = super().step_time(plan)
        if plan.compress_launch is not None:
            return self.launch_time(duration)
        return duration

    def launch_time(self, forward_s: float) -> float:
        """A step that launches a compression batch behind a forward of `forward_s`."""
        duration = forward_s + self.launch_extra_s
        return duration if duration > self.launch_floor_s else self.launch_floor_s

    def forward_time_for(self, work: StepWork) -> float:
        batch = work.num_decode
        if not work.num_prefill:
            if not batch:
                return 0.0
            context = work.decode_context_tokens
            rows = self.decode_rows(batch)  # a captured graph's padded size, else the batch
            value = self._decode_a + self._decode_b * rows + self._decode_c * context
            if self._decode_excess and work.decode_max_context:
                excess = longest_excess(work.decode_max_context, context, batch)
                if self.decode_partitions is not None:
                    excess /= self.decode_partitions.longest_row(rows, context, work.decode_max_context)
                value += self._decode_excess * excess
            if self._decode_shared and work.shared_kv_tokens:
                value += self._decode_shared * min(work.shared_kv_tokens, context)
            return value if value > self._decode_floor else self._decode_floor
        tokens = work.prefill_tokens
        if self.prefill_buckets:
            tokens = padded_tokens(tokens, batch, self.prefill_buckets)
        if not batch:
            return self.prefill_fit.predict(tokens, work.attention_pairs, work.num_prefill)
        # A mixed step runs the prefill path: a host bound (its own, or the prefill's) and the
        # prefill's per-chunk cost.
        return self.mixed_fit.step_time(batch, work.decode_context_tokens, tokens,
                                        work.attention_pairs, work.num_prefill,
                                        work.decode_max_context or work.decode_context_tokens / batch)

    def compress_time_for(self, blocks: Sequence[int], kept_blocks: Sequence[int] | None = None,
                          scoring: str | None = None) -> float:
        # The fit prices the blocks read (what a profile measures); what is kept is not a
        # feature of it, so `kept_blocks` does not change the estimate.
        if self.compress_fit is None:
            raise ConfigError(f"{self.source}: the profile has no \"compress\" section, so it "
                              "cannot time compressions; measure one, or run with compression off "
                              "or the analytic cost model")
        measured = self.compress_fit.predict(sum(blocks), sum(count * count for count in blocks))
        if scoring is None or scoring == self.scoring:
            return measured
        analytic = self.analytic
        if analytic is None:
            if self.run_setup is None:
                raise ConfigError(f"{self.source}: scoring: measured with {self.scoring!r}, but "
                                  f"a request asks for {scoring!r}; load the profile with the "
                                  "run's model and GPU (to scale the analytic cost of that "
                                  "policy), or use --cost-model analytic")
            shape, gpu, knobs = self.run_setup
            analytic = self.analytic = AnalyticCostModel(shape, gpu, **knobs)
        return measured * (analytic.compress_time_for(blocks, kept_blocks, scoring)
                           / analytic.compress_time_for(blocks, kept_blocks))


def longest_excess(max_context: float, context_tokens: float, batch: float) -> float:
    """KV entries the longest decode request holds beyond the batch's mean: what makes a decode
    step cost more than its batch and summed context say, when the kernel gives each request one
    partition (the analytic model's DECODE_PROGRAM_BANDWIDTH)."""
    excess = max_context - context_tokens / batch
    return excess if excess > 0.0 else 0.0


class DecodePartitions:
    """The split-K decode kernel's partitions per sequence at a batch size (its grid rule,
    zipage/decode_grid.py) for one model and GPU, remembered per batch: the simulator prices
    millions of decode steps over a few hundred batch sizes. `split` is the measured engine's
    (the profile's decode_split): with "rule", a step's longest row may take the balanced split."""

    def __init__(self, kv_heads: int, streaming_multiprocessors: int,
                 programs_per_sm: int = PROGRAMS_PER_SM, split: str = "batch") -> None:
        self.kv_heads, self.streaming_multiprocessors = kv_heads, streaming_multiprocessors
        self.programs_per_sm = programs_per_sm
        self.split = split
        self._at: dict[int, int] = {}
        self._wide: dict[int, int] = {}

    def __call__(self, batch: int) -> int:
        count = self._at.get(batch)
        if count is None:
            count = self._at[batch] = decode_num_partitions(
                int(batch), self.kv_heads, self.streaming_multiprocessors, programs_per_sm=self.programs_per_sm)
        return count

    def longest_row(self, batch: int, context_tokens: float, max_context: float) -> int:
        """The partitions of a decode step's longest row: the grid's at `batch`, or where the
        engine's rule takes the balanced split (zipage/decode_grid.py `takes_balanced_split`),
        the balanced split's for it."""
        plain = self(batch)
        if self.split != "rule":
            return plain
        wide = self._wide.get(batch)
        if wide is None:
            wide = self._wide[batch] = decode_grid_partitions(
                int(batch), self.kv_heads, self.streaming_multiprocessors,
                programs_per_sm=self.programs_per_sm, split="balanced")
        if wide == plain:
            return plain
        return max(plain, balanced_row_partitions(
            int(max_context), int(context_tokens), self.kv_heads, self.streaming_multiprocessors, wide,
            programs_per_sm=self.programs_per_sm))


class DecodeRows:
    """The rows a decode step of a batch computes on the measured engine: the smallest of its
    captured graph sizes that holds the batch (zipage/decode_grid.py `graph_batch`), or the batch
    itself (no sizes: an eager engine, or a profile from before the field), remembered per
    batch as `DecodePartitions` is."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.sizes = sizes
        self._at: dict[int, int] = {}

    def __call__(self, batch: int) -> int:
        if not self.sizes:
            return batch
        rows = self._at.get(batch)
        if rows is None:
            rows = self._at[batch] = graph_batch(int(batch), self.sizes)
        return rows


def measured_grid(header: dict[str, Any]) -> int:
    """The decode programs an SM the profile's engine aimed its split-K grid at: the header's, or 4
    for a profile written before the field (every engine ran that grid then)."""
    return header.get(DECODE_PROGRAMS_PER_SM, PROGRAMS_PER_SM)


def decode_partitions(source: str, header: dict[str, Any]) -> DecodePartitions:
    """The partitions the profile's engine gave a decode step's sequences, as the analytic model
    counts them for the same setup: the model preset's KV heads per GPU (under the header's
    tensor parallelism), the GPU table's streaming multiprocessors and the programs an SM the
    engine's grid aimed for (the header's, 4 for a profile without the field). From the header alone,
    so that a profile prices a step the same whichever run loads it."""
    try:
        shape, gpu = get_preset(header["model"]), get_hardware(header["gpu"])
    except (ConfigError, UnknownModelError) as error:
        raise ConfigError(f"{source}: {DECODE_EXCESS}: \"{PER_PARTITION}\" needs the decode "
                          f"kernel's partitions, from the model's KV heads and the GPU's SMs "
                          f"({error}); remove the field to price the excess per entry") from None
    kv_heads = heads_per_gpu(shape.num_kv_heads, int(header.get("tensor_parallel") or 1))
    return DecodePartitions(kv_heads, gpu.streaming_multiprocessors,
                            measured_grid(header), header.get(DECODE_SPLIT, "batch"))


def partition_geometry_known(header: dict[str, Any]) -> bool:
    """Whether `decode_partitions` can count the header's partitions (a preset model and a GPU
    of the table): what a writer asks before it writes decode_excess "per_partition"."""
    try:
        decode_partitions("profile", header)
    except ConfigError:
        return False
    return True


# A longest-request term is fitted only if some decode points hold one request this far (KV
# entries) beyond the mean: balanced steps cannot separate it from the context slope.
MIN_LONGEST_EXCESS = 1024
# A shared-entries term is fitted only if this many decode points share at least this fraction
# of their context: a few sharing steps cannot separate it from the context slope.
MIN_SHARED_POINTS = 8
MIN_SHARED_FRACTION = 0.1
LONGEST_EXCESS, SHARED_TOKENS = "longest_excess", "shared_tokens"
# The longest-request term priced per entry of the longest request's partition (a profile of
# decode_excess "per_partition"): its excess over the mean divided by its decode partitions.
PARTITION_EXCESS = "partition_excess"
EXCESS_TERMS = (LONGEST_EXCESS, PARTITION_EXCESS)
# Optional fields of a decode (or launch) point: the step's longest context and shared entries.
DECODE_DEFAULTS = {"max_context": None, SHARED_TOKENS: 0}


def _decode_work(row: dict[str, Any]) -> StepWork:
    return StepWork(int(row["batch"]), int(row["context_tokens"]),
                    decode_max_context=int(row["max_context"] or 0),
                    shared_kv_tokens=int(row[SHARED_TOKENS]))


def _decode_fit(source: str, rows: list[dict[str, Any]],
                partitions: DecodePartitions | None = None,
                padded: DecodeRows | None = None) -> LinearFit:
    """a + b * batch + c * context_tokens, plus the optional terms the points support:
    d * longest_excess when every point says its longest request (`max_context`: profiles
    fitted from runs whose steps.csv records it), some are unbalanced and the fit finds d > 0
    (with `partitions`, d * partition_excess: the excess over the step's decode partitions);
    e * shared_tokens when enough points share prefix blocks and the fit finds a shared entry
    cheaper than an unshared one but not free (-c <= e < 0). A term the fit rejects is dropped
    and the rest refitted; with neither, the three-term fit, as always. Then the host floor
    over the accepted terms, where the points determine it (`fit_host_floor`). With `padded`
    (a profile's decode_graph_sizes), batch is the rows its graph computed, as predicted."""
    padded = padded or DecodeRows(())
    features = [[padded(row["batch"]), row["context_tokens"]] for row in rows]
    times = [row["time_s"] for row in rows]
    extra: dict[str, list[float]] = {}
    if rows and all(row["max_context"] is not None for row in rows):
        excess = [longest_excess(row["max_context"], row["context_tokens"], row["batch"])
                  for row in rows]
        if max(excess) >= MIN_LONGEST_EXCESS:  # KV entries, whatever the pricing
            if partitions is None:
                extra[LONGEST_EXCESS] = excess
            else:
                extra[PARTITION_EXCESS] = [
                    value / partitions.longest_row(padded(row["batch"]), row["context_tokens"], row["max_context"])
                    for value, row in zip(excess, rows)]
    shared = [min(row[SHARED_TOKENS], row["context_tokens"]) for row in rows]
    sharing = sum(1 for value, row in zip(shared, rows)
                  if value > 0 and value >= MIN_SHARED_FRACTION * row["context_tokens"])
    if sharing >= MIN_SHARED_POINTS:
        extra[SHARED_TOKENS] = shared
    while True:
        names = ("batch", "context_tokens", *extra)
        fit = fit_linear(source, "decode", names,
                         [point + [extra[name][index] for name in extra]
                          for index, point in enumerate(features)], times)
        terms = dict(zip(fit.feature_names, fit.coefficients))
        rejected = [name for name in extra if not (
            terms[name] > 0 if name in EXCESS_TERMS
            else -terms["context_tokens"] <= terms[name] < 0)]
        if not rejected:
            columns = np.column_stack([np.asarray(features, float).reshape(len(rows), 2)]
                                      + [np.asarray(extra[name], float) for name in extra])
            return fit_host_floor(fit, columns, np.asarray(times, float))
        del extra[rejected[0]]


def fit_launch(points: list[tuple[float, float]]) -> tuple[float, float]:
    """The host floor h_l and the extra x_l of a step that launches a compression batch, from
    (forward, measured) pairs, as max(h_l, forward + x_l). x_l is the mean time the launching
    steps took beyond their forwards (a mean, so the simulated run's time sums to the engine's:
    most launches cost nothing extra, a few a couple of milliseconds); h_l the value that best
    predicts them (relative error) given x_l, among the percentiles of the measured times (a
    run launches thousands), 0 when no floor predicts them better."""
    if not points:
        return 0.0, 0.0
    forward, measured = np.asarray(points, dtype=float).T
    extra = max(0.0, float(np.mean(measured - forward)))
    candidates = np.concatenate(([0.0], np.percentile(measured, np.arange(101))))
    predicted = np.maximum((forward + extra)[:, None], candidates[None, :])
    errors = ((predicted / measured[:, None] - 1.0) ** 2).sum(axis=0)
    floor = float(candidates[int(np.argmin(errors))])
    if floor > 0.0:  # the extra then counts only above the floor: refit it there
        above = forward + extra > floor
        if above.any():
            extra = max(0.0, float(np.mean(measured[above] - forward[above])))
    return floor, extra


def _blocks_squared(row: dict) -> float:
    # Without the per-request split, assume the batch's blocks were spread evenly.
    if row["blocks_squared"] is not None:
        return row["blocks_squared"]
    return row["blocks"] ** 2 / row["requests"]
