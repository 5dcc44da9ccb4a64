"""The calibrated cost model: simple linear models fitted to a profile measured on a real GPU.

The profile is read and checked by `zipage.profile`; its sections are fitted here (decode and
compression), in sim/prefill_fit.py and in sim/mixed_fit.py. It is as good as the profile, and
only for the setup measured (the header says which; a run with another is refused). Formats and
fits: docs/cost_model.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from zipage.errors import ConfigError
from zipage.hardware import GPUSpec
from zipage.profile import Validation, check_header, read_points, read_profile, read_validation
from zipage.shape import ModelShape
from zipage.sim.analytic import DEFAULT_CONTENTION
from zipage.sim.cost_model import CostModel, StepWork
from zipage.sim.linear_fit import LinearFit, fit_linear
from zipage.sim.mixed_fit import MixedFit, fit_mixed_points
from zipage.sim.prefill_fit import PREFILL_DEFAULTS, PrefillFit, fit_prefill_points, padded_tokens


class CalibratedCostModel(CostModel):
    """Linear models fitted to a measured profile (format and fits: docs/cost_model.md).

    decode:   a + b * batch + c * context_tokens [+ d * longest_excess, when the points carry
              max_context: the longest request's entries beyond the mean, max - sum / batch]
    prefill:  s * requests + max(h, a + b * new_tokens + c * attention_pairs)   (version 3;
              before it s = h = 0; pairs: sum of T*C + T(T+1)/2)
    mixed:    s * requests + max(h_m, m + decode's b, c terms + prefill's b, c terms)
              (m and, version 3, h_m fitted to the mixed points; h_m = h when they cannot
              determine it)
    A profile with `prefill_buckets` measured an engine that pads prefill and mixed steps of
    up to its largest bucket to the next bucket (its prefill graphs): there new_tokens is the
    padded row count less the decode rows, in the fits and in the predictions alike.
    compress: a + b * blocks [+ c * blocks_squared with the flash redundancy score]
    """

    def __init__(self, decode: LinearFit, prefill: PrefillFit, mixed: MixedFit,
                 compress: LinearFit | None, contention_factor: float, header: dict[str, Any],
                 source: str, validation: Validation | None = None) -> None:
        self.decode_fit, self.prefill_fit, self.mixed_fit = decode, prefill, mixed
        self.compress_fit = compress
        self.contention_factor = contention_factor
        self.header, self.source = header, source
        self.validation = validation
        self.measured_graphs = header.get("graphs")
        self.prefill_buckets = tuple(header.get("prefill_buckets") or ())
        self._decode_a, self._decode_b, self._decode_c = decode.coefficients[:3]
        # Per KV entry the longest request holds beyond the mean (0 when not fitted).
        self._decode_excess = decode.coefficients[3] if len(decode.coefficients) > 3 else 0.0
        self._decode_floor = decode.floor_s

    @classmethod
    def from_profile(cls, profile: str | Path | dict, *, shape: ModelShape | None = None,
                     gpu: GPUSpec | None = None, **knobs: Any) -> "CalibratedCostModel":
        """Fit a profile (a path or an already-parsed dict); check it matches the run if given."""
        source, data = read_profile(profile)
        header = check_header(source, data, shape, gpu, knobs)
        validation = read_validation(source, data)
        redundancy = header.get("redundancy", "lightning")
        decode_rows = read_points(source, data, "decode", ("batch", "context_tokens"),
                                  {"max_context": None})
        decode = _decode_fit(source, decode_rows)
        prefill_rows = read_points(source, data, "prefill", ("new_tokens",), PREFILL_DEFAULTS)
        buckets = tuple(header.get("prefill_buckets") or ())
        prefill = fit_prefill_points(source, data["version"], prefill_rows, buckets)
        mixed_rows = []
        if "mixed" in data:
            mixed_rows = read_points(source, data, "mixed",
                                     ("batch", "context_tokens", "new_tokens"), PREFILL_DEFAULTS)
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
        return cls(decode, prefill, mixed, compress, float(contention), header, source,
                   validation)

    def forward_time_for(self, work: StepWork) -> float:
        batch = work.num_decode
        if not work.num_prefill:
            if not batch:
                return 0.0
            context = work.decode_context_tokens
            value = self._decode_a + self._decode_b * batch + self._decode_c * context
            if self._decode_excess and work.decode_max_context:
                value += self._decode_excess * longest_excess(work.decode_max_context, context,
                                                              batch)
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

    def compress_time_for(self, blocks: Sequence[int],
                          kept_blocks: Sequence[int] | None = None) -> float:
        # The fit prices the blocks read (what a profile measures); what is kept is not a
        # feature of it, so `kept_blocks` does not change the estimate.
        if self.compress_fit is None:
            raise ConfigError(f"{self.source}: the profile has no \"compress\" section, so it "
                              "cannot time compressions; measure one, or run with compression off "
                              "or the analytic cost model")
        return self.compress_fit.predict(sum(blocks), sum(count * count for count in blocks))


def longest_excess(max_context: float, context_tokens: float, batch: float) -> float:
    """KV entries the longest decode request holds beyond the batch's mean: what makes a decode
    step cost more than its batch and summed context say, when the kernel gives each request one
    partition (the analytic model's DECODE_PROGRAM_BANDWIDTH)."""
    excess = max_context - context_tokens / batch
    return excess if excess > 0.0 else 0.0


# A longest-request term is fitted only if some decode points hold one request this far (KV
# entries) beyond the mean: balanced steps cannot separate it from the context slope.
MIN_LONGEST_EXCESS = 1024


def _decode_fit(source: str, rows: list[dict[str, Any]]) -> LinearFit:
    """a + b * batch + c * context_tokens, plus d * longest_excess when every point says its
    longest request (`max_context`: profiles fitted from runs whose steps.csv records it), some
    are unbalanced and the fit finds d > 0; otherwise the three-term fit, as always."""
    names = ("batch", "context_tokens")
    features = [[row["batch"], row["context_tokens"]] for row in rows]
    times = [row["time_s"] for row in rows]
    if rows and all(row["max_context"] is not None for row in rows):
        excess = [longest_excess(row["max_context"], row["context_tokens"], row["batch"])
                  for row in rows]
        if max(excess) >= MIN_LONGEST_EXCESS:
            fit = fit_linear(source, "decode", names + ("longest_excess",),
                             [point + [value] for point, value in zip(features, excess)], times)
            if fit.coefficients[3] > 0:
                return fit
    return fit_linear(source, "decode", names, features, times)


def _blocks_squared(row: dict) -> float:
    # Without the per-request split, assume the batch's blocks were spread evenly.
    if row["blocks_squared"] is not None:
        return row["blocks_squared"]
    return row["blocks"] ** 2 / row["requests"]
