"""Loading a run directory and drawing its timeline, like the paper's appendix figures.

A run directory (written by `zipage replay TRACE --out DIR`, by the simulator and the real engine
alike) holds `summary.json`, `steps.csv`, `requests.csv` and `decisions.log[.gz]`. `load_run`
(`zipage.rundir`, re-exported here) reads the first three into a `RunData`; `plot_timeline`
draws four stacked panels over time: (a) real-time decode throughput (decode and mixed steps)
with the time of prefill steps shaded (decoding waits) and, with chunked prefill, that of mixed
steps, (b) running and waiting requests and the preemptions per bin, (c) block occupancy and
query slots used, (d) each request's TTFT at its arrival and TPOT at its finish. Every curve
is a time-weighted aggregate over fixed-width time bins, computed exactly from the
piecewise-constant step records, so a 100k-step run draws as fast as a 5-step one; `plot_run`
reads a run's steps.csv and requests.csv a chunk at a time, so a run of millions of steps and
requests plots in bounded memory (panel (d) draws an even sample of at most
`MAX_LATENCY_POINTS` requests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from zipage.rundir import (  # noqa: F401 - load_run, RunData and the file names live here too
    DECISIONS_FILE,
    REQUESTS_FILE,
    STEPS_FILE,
    SUMMARY_FILE,
    RunData,
    iter_request_chunks,
    iter_step_chunks,
    load_run,
    read_summary,
    run_file,
)

DEFAULT_BINS = 1000
# The throughput curve is smoothed over this share of the run's duration: enough to hide the
# step-to-step jitter of async compression, short enough to keep the preemption waves visible.
SMOOTHING_FRACTION = 0.02
# Panel (d) draws one dot per request up to this many, an even sample beyond: more dots only
# overplot, and a day of traffic (millions of requests) would take minutes to draw.
MAX_LATENCY_POINTS = 20_000
# Latencies spanning more than this ratio (a TPOT of 20 ms beside a TTFT of minutes) go on a log
# axis, where both stay readable.
LOG_SCALE_RATIO = 30.0
# The request columns panel (d) is computed from.
LATENCY_COLUMNS = ["arrival", "first_token", "finish", "output_len"]


@dataclass
class _BinnedSteps:
    """Time-weighted per-bin aggregates of the step records (NaN where no step covers a bin)."""

    edges: np.ndarray
    decode_tokens: np.ndarray
    decode_seconds: np.ndarray
    prefill_share: np.ndarray  # prefill-only steps: nobody decodes
    mixed_share: np.ndarray  # mixed steps (chunked prefill): decodes and prompt chunks together
    running: np.ndarray
    waiting: np.ndarray
    block_occupancy_percent: np.ndarray
    slots_used: np.ndarray
    preemptions: np.ndarray  # requests preempted by the steps starting in the bin


@dataclass
class _Latencies:
    """Panel (d)'s dots: TTFT at arrival, TPOT at finish (NaN where undefined), of `shown` of the
    run's `total` requests."""

    arrival: np.ndarray
    ttft: np.ndarray
    finish: np.ndarray
    tpot: np.ndarray
    total: int

    @property
    def shown(self) -> int:
        return len(self.arrival)


# The per-step values whose time integrals per bin the panels are drawn from.
_RATES = ("covered", "decode_tokens", "decode_seconds", "prefill", "mixed", "running", "waiting",
          "occupancy", "slots_used")
# The columns of steps.csv they are computed from.
BINNED_COLUMNS = ["step_id", "t_start", "t_end", "kind", "n_decode", "n_running", "n_waiting",
                  "blocks_used", "blocks_total", "slots_used", "preempted"]


def _bin_steps(steps: pd.DataFrame, bins: int) -> _BinnedSteps:
    return _bin_step_chunks(lambda: [steps], bins)


def _bin_step_chunks(chunks: Callable[[], Iterable[pd.DataFrame]], bins: int) -> _BinnedSteps | None:
    """Bin the step records that `chunks()` yields, chunk by chunk (a 2M-step run's steps.csv is
    never whole in memory); it is called twice: the run's time span first, then the sums. None
    when there are no steps."""
    origin, last = np.inf, -np.inf
    for chunk in chunks():
        if len(chunk):
            origin = min(origin, chunk["t_start"].min())
            last = max(last, chunk["t_end"].max())
    if origin == np.inf:
        return None
    span = last - origin
    # A run of zero-duration steps still needs a non-empty axis.
    edges = origin + np.linspace(0.0, span if span > 0 else 1.0, bins + 1)
    integrals = {name: np.zeros(bins) for name in _RATES}
    preemptions = np.zeros(bins)
    for chunk in chunks():
        if len(chunk):
            for name, integral in _chunk_integrals(chunk, edges).items():
                integrals[name] += integral
            # A preemption is an event, not a rate: counted in the bin where its step starts.
            preemptions += np.histogram(chunk["t_start"], bins=edges,
                                        weights=chunk["preempted"])[0]
    covered = integrals["covered"]

    def time_weighted_mean(name: str) -> np.ndarray:
        # NaN where no step covers the bin. A bin that steps barely touch can come out with a
        # covered time of 0 (or a few ulps) beside an integral of a few ulps: that is no share.
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(covered > 0, integrals[name] / covered, np.nan)

    def share(name: str) -> np.ndarray:
        """The share of a bin's covered time in `name`'s steps: 0 where none, never past 1."""
        return np.clip(np.nan_to_num(time_weighted_mean(name)), 0.0, 1.0)

    return _BinnedSteps(
        edges=edges,
        decode_tokens=integrals["decode_tokens"],
        decode_seconds=integrals["decode_seconds"],
        prefill_share=share("prefill"),
        mixed_share=share("mixed"),
        running=time_weighted_mean("running"),
        waiting=time_weighted_mean("waiting"),
        block_occupancy_percent=time_weighted_mean("occupancy"),
        slots_used=time_weighted_mean("slots_used"),
        preemptions=preemptions,
    )


def _latencies(chunks: Iterable[pd.DataFrame], total: int | None) -> _Latencies:
    """TTFT and TPOT of every `stride`-th request of `chunks` (request rows in file order), so
    at most about MAX_LATENCY_POINTS are kept whatever the run's length; `total` is the row
    count summary.json records (None: older runs, all rows kept)."""
    stride = max(1, -(-(total or 0) // MAX_LATENCY_POINTS))
    kept, seen = [], 0
    for chunk in chunks:
        rows = np.arange(seen, seen + len(chunk))
        seen += len(chunk)
        kept.append(chunk[rows % stride == 0])
    requests = pd.concat(kept) if kept else pd.DataFrame(columns=LATENCY_COLUMNS)
    arrival, first, finish, output = (requests[name].to_numpy(dtype=float)
                                      for name in LATENCY_COLUMNS)
    # TPOT is the mean gap between output tokens: undefined for a one-token request (NaN, like an
    # unfinished request's times, is not drawn).
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot = np.where(output > 1, (finish - first) / (output - 1), np.nan)
    return _Latencies(arrival=arrival, ttft=first - arrival, finish=finish, tpot=tpot,
                      total=seen)


def _chunk_integrals(chunk: pd.DataFrame, edges: np.ndarray) -> dict[str, np.ndarray]:
    """The integral over each bin of every rate, over the steps of one chunk."""
    ordered = chunk.sort_values(["t_start", "step_id"])
    start = ordered["t_start"].to_numpy(dtype=float)
    end = ordered["t_end"].to_numpy(dtype=float)
    duration = end - start
    # Every record is constant over its step, and steps do not overlap, so its integral over time
    # is piecewise linear with knots at the step boundaries: interpolating the running integral
    # at the bin edges gives the exact integral over each bin, even when a step is longer than a
    # bin. Before the chunk's first step it is 0 and after its last the chunk's total (np.interp
    # holds the end values), so the chunks' integrals add up to the whole run's.
    knots = np.column_stack([start, end]).ravel()

    def integral_per_bin(rate: np.ndarray) -> np.ndarray:
        cumulative_at_end = np.cumsum(rate * duration)
        cumulative_at_start = cumulative_at_end - rate * duration
        values = np.column_stack([cumulative_at_start, cumulative_at_end]).ravel()
        return np.diff(np.interp(edges, knots, values))

    def column(name: str) -> np.ndarray:
        return ordered[name].to_numpy(dtype=float)

    # Decode and mixed steps decode; prefill and idle steps do not.
    is_decode = (ordered["n_decode"] > 0).to_numpy()
    # Decode tokens are spread evenly over their step; a zero-duration step has no rate to spread.
    has_rate = is_decode & (duration > 0)
    token_rate = np.divide(column("n_decode"), duration, out=np.zeros_like(duration),
                           where=has_rate)
    blocks_total = column("blocks_total")
    occupancy_percent = np.divide(100.0 * column("blocks_used"), blocks_total,
                                  out=np.zeros_like(duration), where=blocks_total > 0)
    rates = {
        "covered": np.ones_like(duration),
        "decode_tokens": token_rate,
        "decode_seconds": is_decode.astype(float),
        "prefill": (ordered["kind"] == "prefill").to_numpy(dtype=float),
        "mixed": (ordered["kind"] == "mixed").to_numpy(dtype=float),
        "running": column("n_running"),
        "waiting": column("n_waiting"),
        "occupancy": occupancy_percent,
        "slots_used": column("slots_used"),
    }
    return {name: integral_per_bin(rate) for name, rate in rates.items()}


def _smoothed_rate(tokens: np.ndarray, seconds: np.ndarray, window_bins: int) -> np.ndarray:
    # Smoothing the two sums separately and dividing weights each bin by its decode time, so a
    # bin with one short decode step cannot dominate the curve.
    def rolling_sum(values: np.ndarray) -> np.ndarray:
        return pd.Series(values).rolling(window_bins, center=True, min_periods=1).sum().to_numpy()

    smoothed_seconds = rolling_sum(seconds)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(smoothed_seconds > 0, rolling_sum(tokens) / smoothed_seconds, np.nan)


def plot_run(directory: str | Path, bins: int = DEFAULT_BINS) -> Path:
    """Write `timeline.png` into a run directory (`zipage.rundir`)."""
    directory = Path(directory)
    return _save(run_figure(directory, bins), directory / "timeline.png")


def run_figure(directory: str | Path, bins: int = DEFAULT_BINS) -> Figure:
    """The timeline figure of a run directory. steps.csv is read a chunk at a time, twice
    (`_bin_step_chunks`), and requests.csv once, sampled, so a run of millions of steps and
    requests plots in bounded memory."""
    summary = read_summary(directory)
    binned = _bin_step_chunks(
        lambda: iter_step_chunks(directory, summary, columns=BINNED_COLUMNS), bins)
    latencies = _latencies(iter_request_chunks(directory, summary, columns=LATENCY_COLUMNS),
                           summary.get("rows", {}).get(REQUESTS_FILE))
    return _figure(binned, latencies, run_title(summary), summary["max_concurrency"])


def run_title(summary: dict) -> str:
    """Trace, model, driver and device, and the knobs that shape the schedule (older run
    directories may lack some of them)."""
    settings = summary.get("settings", {})
    config = settings.get("config", {})
    device = summary.get("device") or settings.get("hardware")
    head = " · ".join(str(part) for part in (summary.get("trace"), settings.get("model"),
                                             summary.get("driver"), device) if part)
    if not config:
        return head
    if config.get("compress", True):
        knobs = (f"KV budget {config.get('kv_budget')}, block {config.get('block_size')}, "
                 f"{'hybrid' if config.get('hybrid', True) else 'constrained'} scheduling")
    else:
        knobs = f"Full KV (no compression), block {config.get('block_size')}"
    return f"{head}\n{knobs}"


def plot_timeline(steps: pd.DataFrame, path: str | Path, title: str | None = None, *,
                  requests: pd.DataFrame | None = None, max_concurrency: int | None = None,
                  bins: int = DEFAULT_BINS) -> Path:
    """Write the four-panel timeline PNG of a run's step records (and request records, for
    panel (d)) to `path`.

    `max_concurrency` (the run's query slots M, `summary["max_concurrency"]`) draws the slot limit
    in panel (c) when given. Returns the path written.
    """
    return _save(timeline_figure(steps, title, requests=requests,
                                 max_concurrency=max_concurrency, bins=bins), path)


def timeline_figure(steps: pd.DataFrame, title: str | None = None, *,
                    requests: pd.DataFrame | None = None, max_concurrency: int | None = None,
                    bins: int = DEFAULT_BINS) -> Figure:
    """The figure `plot_timeline` writes."""
    binned = None if steps.empty else _bin_steps(steps, bins)
    latencies = None if requests is None else _latencies([requests[LATENCY_COLUMNS]],
                                                         len(requests))
    return _figure(binned, latencies, title, max_concurrency)


def _save(figure: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path


def _figure(binned: _BinnedSteps | None, latencies: _Latencies | None, title: str | None,
            max_concurrency: int | None) -> Figure:
    # A bare Figure on an Agg canvas: no pyplot, so no display and no global figure registry.
    figure = Figure(figsize=(11, 10.5), layout="constrained")
    FigureCanvasAgg(figure)
    throughput_axis, queue_axis, memory_axis, latency_axis = figure.subplots(4, 1, sharex=True)
    if title:
        figure.suptitle(title)
    if binned is None:
        throughput_axis.text(0.5, 0.5, "no steps recorded", ha="center", va="center",
                             transform=throughput_axis.transAxes)
    else:
        _draw_panels(binned, throughput_axis, queue_axis, memory_axis, max_concurrency)
    # Requests share the steps' clock; a run without steps counts from its first arrival.
    origin = (binned.edges[0] if binned is not None else
              np.nanmin(latencies.arrival) if latencies is not None and latencies.shown else 0.0)
    _draw_latencies(latencies, latency_axis, origin)
    latency_axis.set_xlabel("time since the first step (s)")
    return figure


def _per_bin(values: np.ndarray) -> np.ndarray:
    # A steps-post line needs one value per bin edge to reach the end of the last bin.
    return np.append(values, values[-1])


def _draw_panels(binned: _BinnedSteps, throughput_axis: Axes, queue_axis: Axes,
                 memory_axis: Axes, max_concurrency: int | None) -> None:
    edges = binned.edges - binned.edges[0]
    centres = (edges[:-1] + edges[1:]) / 2
    with np.errstate(divide="ignore", invalid="ignore"):
        raw_rate = np.where(binned.decode_seconds > 0,
                            binned.decode_tokens / binned.decode_seconds, np.nan)
    window_bins = max(1, round(SMOOTHING_FRACTION * len(centres)))
    # Prefill share on an axis of its own (right), drawn under the throughput curves.
    share_axis = throughput_axis.twinx()
    prefill_percent = 100 * _per_bin(binned.prefill_share)
    share_axis.fill_between(edges, 0, prefill_percent, step="post",
                            color="tab:orange", alpha=0.2, linewidth=0,
                            label="prefill share of time")
    if binned.mixed_share.any():  # chunked prefill: mixed steps stacked on the prefill share
        share_axis.fill_between(edges, prefill_percent,
                                prefill_percent + 100 * _per_bin(binned.mixed_share),
                                step="post", color="tab:olive", alpha=0.2, linewidth=0,
                                label="mixed-step share of time")
    share_axis.set_ylim(0, 100)
    share_axis.set_ylabel(("prefill and mixed" if binned.mixed_share.any() else "prefill")
                          + " share of time (%)", color="tab:orange")
    share_axis.tick_params(axis="y", colors="tab:orange")
    throughput_axis.set_zorder(share_axis.get_zorder() + 1)
    throughput_axis.patch.set_visible(False)
    throughput_axis.plot(edges, _per_bin(raw_rate), drawstyle="steps-post", color="tab:blue",
                         alpha=0.25, linewidth=0.6, label="per bin")
    throughput_axis.plot(centres, _smoothed_rate(binned.decode_tokens, binned.decode_seconds,
                                                 window_bins),
                         color="tab:blue", linewidth=1.5, label=f"smoothed ({window_bins} bins)")
    throughput_axis.set_ylabel("decode tokens / s")
    throughput_axis.set_ylim(bottom=0)
    throughput_axis.set_title("(a) real-time throughput", loc="left", fontsize=10)
    _legend_outside(throughput_axis, share_axis)

    queue_axis.plot(edges, _per_bin(binned.running), drawstyle="steps-post", color="tab:green",
                    label="running")
    queue_axis.plot(edges, _per_bin(binned.waiting), drawstyle="steps-post", color="tab:red",
                    label="waiting")
    queue_axis.set_ylabel("requests")
    queue_axis.set_ylim(bottom=0)
    queue_axis.set_title("(b) running and waiting requests", loc="left", fontsize=10)
    # Preemptions as one stem per bin on an axis of their own: AMC23 at the defaults preempts
    # 4,314 times, which a marker per event would draw as a smear; a per-bin count keeps the
    # waves readable beside the waiting queue they refill.
    preemption_axis = queue_axis.twinx()
    preempting = binned.preemptions > 0
    preemption_axis.vlines(centres[preempting], 0, binned.preemptions[preempting],
                           color="black", linewidth=0.8, alpha=0.7,
                           label=f"preemptions per bin ({int(binned.preemptions.sum()):,} in all)")
    preemption_axis.set_ylabel("preemptions per bin")
    preemption_axis.set_ylim(0, max(1.0, 1.08 * binned.preemptions.max()))
    _legend_outside(queue_axis, preemption_axis)

    # Block occupancy as a filled area, so the slot line on the twin axis cannot hide it.
    occupancy = _per_bin(binned.block_occupancy_percent)
    memory_axis.fill_between(edges, 0, np.nan_to_num(occupancy), step="post",
                             color="tab:purple", alpha=0.2, linewidth=0)
    memory_axis.plot(edges, occupancy, drawstyle="steps-post", color="tab:purple",
                     linewidth=1.5, label="blocks used (%)")
    memory_axis.set_ylabel("block occupancy (%)", color="tab:purple")
    memory_axis.set_ylim(0, 105)
    slot_axis = memory_axis.twinx()
    slot_axis.plot(edges, _per_bin(binned.slots_used), drawstyle="steps-post", color="tab:brown",
                   linewidth=1.0, linestyle=(0, (4, 2)), label="query slots used")
    top = np.nanmax(binned.slots_used) if np.isfinite(binned.slots_used).any() else 0
    if max_concurrency is not None:
        slot_axis.axhline(max_concurrency, color="black", linestyle=":", linewidth=1.0,
                          label=f"query slots M = {max_concurrency}")
        top = max(top, max_concurrency)
    slot_axis.set_ylabel("query slots used", color="tab:brown")
    slot_axis.set_ylim(0, max(1.0, 1.08 * top))
    memory_axis.set_title("(c) block occupancy and query slots", loc="left", fontsize=10)
    _legend_outside(memory_axis, slot_axis)


def _draw_latencies(latencies: _Latencies | None, axis: Axes, origin: float) -> None:
    axis.set_title("(d) request latency: TTFT at arrival, TPOT at finish"
                   + (f" (an even sample of {latencies.shown:,} of {latencies.total:,} requests)"
                      if latencies is not None and latencies.shown < latencies.total else ""),
                   loc="left", fontsize=10)
    if latencies is None or not (np.isfinite(latencies.ttft).any()
                                 or np.isfinite(latencies.tpot).any()):
        axis.text(0.5, 0.5, "no request latencies recorded", ha="center", va="center",
                  transform=axis.transAxes)
        return
    # Rasterized: tens of thousands of dots stay one image, not one path each; smaller dots
    # when there are many, so a dense run reads as a band rather than a blot.
    size = 14 if latencies.shown < 2_000 else 3
    for at, value, colour, label in ((latencies.arrival, latencies.ttft, "tab:red",
                                      "TTFT, at arrival"),
                                     (latencies.finish, latencies.tpot, "tab:blue",
                                      "TPOT, at finish")):
        defined = np.isfinite(value)  # unfinished, or one token: no TPOT
        axis.scatter(at[defined] - origin, value[defined], s=size, linewidths=0, color=colour,
                     alpha=0.6, rasterized=True, label=label)
    values = np.concatenate([latencies.ttft, latencies.tpot])
    positive = values[np.isfinite(values) & (values > 0)]
    if positive.size and positive.max() > LOG_SCALE_RATIO * positive.min():
        axis.set_yscale("log")
        axis.set_ylabel("latency (s, log scale)")
    else:
        axis.set_ylim(bottom=0)
        axis.set_ylabel("latency (s)")
    _legend_outside(axis)


def _legend_outside(*axes: Axes) -> None:
    """One legend for the curves of `axes`, right of the panel where it can hide no curve."""
    handles = [handle for axis in axes for handle in axis.get_legend_handles_labels()[0]]
    labels = [label for axis in axes for label in axis.get_legend_handles_labels()[1]]
    axes[0].legend(handles, labels, loc="upper left", bbox_to_anchor=(1.08, 1.0), fontsize=8,
                   borderaxespad=0.0)
