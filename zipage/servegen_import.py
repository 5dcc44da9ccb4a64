"""ServeGen's client pools in: Alibaba Cloud Model Studio's published workload data
(alibaba/ServeGen, Apache-2.0) composed into a Zipage trace.

ServeGen publishes no request log. It publishes, per model (`data/language/m-large`,
`data/reason/deepseek-r1`, ...), one pair of files per client: `chunk-N-trace.csv`, a row per
600 s window of the day (`timestamp,rate,cv,pattern,shape,scale`: requests a second and the
inter-arrival distribution, Gamma or Weibull, that the paper fitted; an empty pattern is an idle
window), and `chunk-N-dataset.json`, the client's length distributions for each part of the day
(`input_tokens`, `output_tokens`, and for reasoning models `reason_ratio`: the share of the
output that is thinking; multimodal pools give `text_tokens` and, per medium, a count of items and
each item's tokens), each a Python dict literal {value: probability}. The paper's own
generator composes a workload client by client from these; so does this reader
(docs/traces.md, "ServeGen pools"):

- a client's window holds Poisson(rate x window) requests, spaced by inter-arrival times drawn
  from the window's fitted distribution and scaled to fill the window (the fit gives the
  burstiness, the rate the count);
- each request's lengths are drawn from the client's distributions of the latest part of the
  day at or before its window, each field on its own draw (the release gives marginals only);
  `reasoning_len` = round(reason_ratio x output_len); a multimodal prompt is its text tokens plus
  the tokens of each image, audio clip and video it carries (count drawn, then each item's
  tokens), which the KV cache holds like any prompt token;
- every draw is a pure function of (seed, client, window), so a `--span` of the day holds the
  very requests the whole day holds there, and ids (`servegen-cC-T-K`: client C, window start T,
  K-th request of that window) are stable under spans and samples.

Requests are made a window at a time, in arrival order, so a day of traffic (1.4M requests for
the DeepSeek-R1 pool) streams in the memory of one window.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from zipage.errors import TraceError
from zipage.production_rows import ImportOptions, _check_options, _skip_reason
from zipage.trace import ARRIVAL_DECIMALS, TraceRequest, stable_hash

PATTERNS = ("Gamma", "Weibull")  # the inter-arrival fits ServeGen's release uses
REASON_FIELD = "reason_ratio"
MEDIA = ("image", "audio", "video")  # multimodal pools: `text_tokens`, then `M_count`, `M_tokens`

_PAIR = re.compile(r"\s*([-+0-9.eE]+)\s*:\s*([-+0-9.eE]+)\s*(?:,|$)")


@dataclass(frozen=True)
class _Window:
    start: float
    size: float
    rate: float
    pattern: str
    shape: float
    scale: float


@dataclass(frozen=True)
class _Lengths:
    """One part of the day's distributions: values and cumulative probabilities per field."""
    fields: dict[str, tuple[np.ndarray, np.ndarray]]

    def draw(self, field: str, uniforms: np.ndarray) -> np.ndarray:
        values, cumulative = self.fields[field]
        picks = np.searchsorted(cumulative, uniforms * cumulative[-1], side="right")
        return values[np.minimum(picks, len(values) - 1)]


@dataclass(frozen=True)
class _Client:
    number: int
    windows: tuple[_Window, ...]
    parts: tuple[tuple[float, _Lengths], ...]  # (start of the part of the day, its lengths)

    def lengths_at(self, time_s: float) -> _Lengths | None:
        chosen = None
        for start, lengths in self.parts:
            if start <= time_s:
                chosen = lengths
        return chosen


def looks_like_servegen(path: str | os.PathLike[str]) -> bool:
    """A directory holding ServeGen client files (`chunk-N-trace.csv`)."""
    folder = Path(path)
    return folder.is_dir() and any(folder.glob("chunk-*-trace.csv"))


class ServeGenStream:
    """A ServeGen model directory read as a trace (a `TraceStream`): its clients are read when it
    is opened, and each window's requests made only when the replay reaches them, anew each time
    it is iterated."""

    format = "servegen"

    def __init__(self, path: str | os.PathLike[str],
                 options: ImportOptions = ImportOptions()) -> None:
        _check_options(options)
        self.options = options
        folder = Path(path)
        self.name = options.name or folder.name or "servegen"
        self.clients = _read_pool(folder)
        self.rows = sum(1 for client in self.clients for _ in client.windows)

    def __iter__(self) -> Iterator[TraceRequest]:
        return self.requests(Counter())

    def requests(self, skipped: Counter) -> Iterator[TraceRequest]:
        """The pool's requests in arrival order; each one not kept is counted in `skipped`."""
        options = self.options
        start, duration = options.window or (0.0, math.inf)
        by_start: dict[float, list[tuple[_Client, _Window]]] = {}
        for client in self.clients:
            for window in client.windows:
                if window.start + window.size > start and window.start < start + duration:
                    by_start.setdefault(window.start, []).append((client, window))
        for window_start in sorted(by_start):
            made = []
            for client, window in by_start[window_start]:
                made.extend(self._window_requests(client, window, skipped))
            made.sort(key=lambda item: item[0])  # stable: client order among equal times
            for time_s, name, prompt_len, output_len, reasoning_len, draw in made:
                # On the trace's microsecond grid first, so a span keeps exactly the requests
                # whose whole-day arrivals fall in it.
                offset = round(time_s, ARRIVAL_DECIMALS) - start
                reason = _skip_reason(prompt_len, output_len, offset, duration, draw, options)
                if reason is not None:
                    skipped[reason] += 1
                    continue
                yield TraceRequest(
                    id=name, arrival_s=round(offset / options.speedup, ARRIVAL_DECIMALS),
                    prompt_len=prompt_len, output_len=output_len, reasoning_len=reasoning_len)

    def _window_requests(self, client: _Client, window: _Window, skipped: Counter
                         ) -> list[tuple[float, str, int, int, int, float]]:
        """The window's requests as (time, id, prompt, output, thinking, sample draw)."""
        rng = np.random.default_rng(
            [self.options.seed, stable_hash(f"servegen\0{client.number}"), int(window.start)])
        count = int(rng.poisson(window.rate * window.size))
        if count == 0:
            return []
        lengths = client.lengths_at(window.start)
        if lengths is None:
            skipped["no length distribution before its window (client file)"] += count
            return []
        gaps = _gaps(window, count + 1, rng)
        times = window.start + np.cumsum(gaps)[:count] * (window.size / gaps.sum())
        # A heavy-tailed fit can leave the last gap below a float's resolution: keep every
        # arrival inside its window once rounded to the trace's microseconds.
        times = np.minimum(times, window.start + window.size - 10.0 ** -ARRIVAL_DECIMALS)
        uniforms = rng.random((3, count))
        prompts = lengths.draw("input_tokens", uniforms[0]).astype(np.int64)
        prompts += _media_tokens(lengths, count, rng)
        outputs = lengths.draw("output_tokens", uniforms[1]).astype(np.int64)
        if REASON_FIELD in lengths.fields:
            ratios = np.clip(lengths.draw(REASON_FIELD, uniforms[2]), 0.0, 1.0)
            thinking = np.minimum(np.rint(ratios * outputs).astype(np.int64), outputs)
        else:
            thinking = np.zeros(count, dtype=np.int64)
        sample_draws = rng.random(count)
        stem = f"servegen-c{client.number}-{int(window.start)}"
        return [(time_s, f"{stem}-{k}", prompt, output, max(0, think), draw)
                for k, (time_s, prompt, output, think, draw) in enumerate(zip(
                    times.tolist(), prompts.tolist(), outputs.tolist(), thinking.tolist(),
                    sample_draws.tolist()))]


def _media_tokens(lengths: _Lengths, count: int, rng: np.random.Generator) -> np.ndarray:
    """Each request's tokens of images, audio and video (zeros for a text pool)."""
    total = np.zeros(count, dtype=np.int64)
    for medium in MEDIA:
        if f"{medium}_count" not in lengths.fields:
            continue
        items = lengths.draw(f"{medium}_count", rng.random(count)).astype(np.int64)
        tokens = lengths.draw(f"{medium}_tokens", rng.random(int(items.sum()))).astype(np.int64)
        owners = np.repeat(np.arange(count), items)
        total += np.bincount(owners, weights=tokens, minlength=count).astype(np.int64)
    return total


def _gaps(window: _Window, count: int, rng: np.random.Generator) -> np.ndarray:
    if window.pattern == "Gamma":
        gaps = rng.gamma(window.shape, window.scale, count)
    else:
        gaps = rng.weibull(window.shape, count) * window.scale
    gaps = np.maximum(gaps, 0.0)
    if not np.isfinite(gaps).all() or gaps.sum() <= 0:
        return np.ones(count)  # a degenerate fit: evenly spaced, the count still holds
    return gaps


def _read_pool(folder: Path) -> list[_Client]:
    if not folder.is_dir():
        raise TraceError(f"{folder}: a ServeGen pool is a directory (e.g. ServeGen's "
                         f"data/reason/deepseek-r1), not a file")
    traces = sorted(folder.glob("chunk-*-trace.csv"), key=_client_number)
    if not traces:
        raise TraceError(f"{folder}: no chunk-N-trace.csv in it; give a ServeGen model "
                         f"directory such as data/reason/deepseek-r1")
    clients = []
    for trace_path in traces:
        number = _client_number(trace_path)
        dataset_path = folder / f"chunk-{number}-dataset.json"
        if not dataset_path.is_file():
            raise TraceError(f"{trace_path}: its client's length distributions "
                             f"{dataset_path.name} are missing beside it")
        clients.append(_Client(number, _read_windows(trace_path), _read_parts(dataset_path)))
    return clients


def _client_number(path: Path) -> int:
    part = path.name.split("-")[1]
    if not part.isdigit():
        raise TraceError(f"{path}: expected a ServeGen client file named chunk-N-trace.csv or "
                         f"chunk-N-dataset.json, N a number")
    return int(part)


def _read_windows(path: Path) -> tuple[_Window, ...]:
    rows = []
    try:
        with open(path, newline="", encoding="utf-8") as file:
            for line, row in enumerate(csv.reader(file), start=1):
                if not row:
                    continue
                if len(row) != 6:
                    raise TraceError(f"{path}:{line}: expected 6 columns (timestamp, rate, cv, "
                                     f"pattern, shape, scale), got {len(row)}")
                rows.append((line, row))
    except (OSError, UnicodeDecodeError) as error:
        raise TraceError(f"{path}: cannot read the client's windows: {error}") from None
    starts = [_number(row[0], "timestamp", path, line) for line, row in rows]
    if starts != sorted(starts) or len(set(starts)) != len(starts):
        raise TraceError(f"{path}: the window timestamps must increase, row by row")
    # A window lasts until the next one starts; the last one as long as the one before it.
    sizes = [b - a for a, b in zip(starts, starts[1:])]
    sizes.append(sizes[-1] if sizes else 600.0)
    windows = []
    for (line, row), start, size in zip(rows, starts, sizes):
        pattern = row[3].strip()
        if not pattern:
            continue  # an idle window
        if pattern not in PATTERNS:
            raise TraceError(f"{path}:{line}: unknown arrival pattern {pattern!r}; ServeGen's "
                             f"are {', '.join(PATTERNS)}")
        rate, shape, scale = (_number(row[i], name, path, line)
                              for i, name in ((1, "rate"), (4, "shape"), (5, "scale")))
        if rate < 0 or shape <= 0 or scale <= 0:
            raise TraceError(f"{path}:{line}: rate must be >= 0 and shape, scale > 0, got "
                             f"rate {rate}, shape {shape}, scale {scale}")
        if rate > 0:
            windows.append(_Window(start, size, rate, pattern, shape, scale))
    return tuple(windows)


def _number(text: str, column: str, path: Path, line: int) -> float:
    try:
        value = float(text)
    except ValueError:
        raise TraceError(f"{path}:{line}: {column} must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise TraceError(f"{path}:{line}: {column} must be finite, got {text!r}")
    return value


def _read_parts(path: Path) -> tuple[tuple[float, _Lengths], ...]:
    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise TraceError(f"{path}: not a ServeGen dataset file (JSON): {error}") from None
    if not isinstance(data, dict):
        raise TraceError(f"{path}: expected a JSON object of parts of the day, "
                         f"{{\"0\": {{\"input_tokens\": ...}}, ...}}")
    parts = []
    for key, fields in data.items():
        where = f"{path}: part {key!r}"
        try:
            start = float(key)
        except ValueError:
            raise TraceError(f"{where}: the key must be the part's start in seconds") from None
        if not isinstance(fields, dict):
            raise TraceError(f"{where}: expected an object of fields")
        # A multimodal pool names its text `text_tokens`; read as `input_tokens`, plus media.
        names = {"input_tokens": "text_tokens" if "text_tokens" in fields else "input_tokens",
                 "output_tokens": "output_tokens", REASON_FIELD: REASON_FIELD}
        for medium in MEDIA:
            if f"{medium}_count" in fields:
                names[f"{medium}_count"] = f"{medium}_count"
                names[f"{medium}_tokens"] = f"{medium}_tokens"
        missing = [source for name, source in names.items()
                   if source not in fields and name != REASON_FIELD]
        if missing:
            raise TraceError(f"{where}: no {missing[0]} distribution")
        parsed = {}
        for name, source in names.items():
            if source in fields:
                parsed[name] = _distribution(fields[source], f"{where}, {source}")
        if any(values is None for values in parsed.values()):
            continue  # an empty distribution: ServeGen skips the part, so do we
        parts.append((start, _Lengths(parsed)))
    parts.sort(key=lambda part: part[0])
    return tuple(parts)


def _distribution(text: object, where: str) -> tuple[np.ndarray, np.ndarray] | None:
    """A {value: probability} literal as (values, cumulative probabilities), or None if empty."""
    if not isinstance(text, str) or not text.strip().startswith("{") \
            or not text.strip().endswith("}"):
        raise TraceError(f"{where}: expected a {{value: probability, ...}} literal as text")
    body = text.strip()[1:-1]
    if not body.strip():
        return None
    pairs = _PAIR.findall(body)
    if sum(len(a) + len(b) for a, b in pairs) == 0 or len(pairs) != body.count(":"):
        raise TraceError(f"{where}: expected numbers as {{value: probability, ...}}")
    try:
        values = np.array([float(a) for a, _ in pairs])
        weights = np.array([float(b) for _, b in pairs])
    except ValueError:  # e.g. "1.2.3": the characters of a number, not a number
        raise TraceError(f"{where}: expected numbers as {{value: probability, ...}}") from None
    if not (np.isfinite(values).all() and np.isfinite(weights).all()) or (weights < 0).any() \
            or weights.sum() <= 0:
        raise TraceError(f"{where}: probabilities must be finite, >= 0 and not all 0")
    order = np.argsort(values, kind="stable")
    return values[order], np.cumsum(weights[order])
