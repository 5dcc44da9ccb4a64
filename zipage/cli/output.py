"""What a command prints and the status it exits with: the run summary, progress bars, exit codes."""

from __future__ import annotations

import argparse
import sys

# Exit statuses (docs/engine.md): 0 every request completed; 1 a `zipage compare --max-error`
# gate failed; 2 a mistake in the input, nothing ran; 3 the run finished and wrote its results,
# but some requests failed (e.g. too long for --max-model-len); 130 interrupted; 141 stdout
# closed early.
EXIT_OK = 0
EXIT_GATE = 1  # zipage compare: a --max-error gate was exceeded
EXIT_USAGE = 2
EXIT_REQUESTS_FAILED = 3

SIMULATOR = "simulator"  # the driver a simulated run's summary names

SUMMARY_ROWS = [
    ("requests", "requests", "{}"), ("completed", "completed", "{}"), ("failed", "failed", "{}"),
    ("output tokens", "output_tokens", "{:,}"), ("makespan (s)", "makespan_s", "{:,.1f}"),
    ("throughput (tok/s)", "tps", "{:,.1f}"),
    # Over the same makespan: finished requests, prompt tokens, prompt + output tokens.
    ("throughput (req/s)", "requests_per_s", "{:,.2f}"),
    ("input throughput (tok/s)", "input_tps", "{:,.1f}"),
    ("total throughput (tok/s)", "total_tps", "{:,.1f}"),
    ("mean TTFT (s)", "mean_ttft_s", "{:,.3f}"), ("p90 TTFT (s)", "ttft_p90_s", "{:,.3f}"),
    ("p99 TTFT (s)", "ttft_p99_s", "{:,.3f}"), ("mean TPOT (ms)", "mean_tpot_ms", "{:.2f}"),
    ("p99 TPOT (ms)", "tpot_p99_ms", "{:.2f}"),
    ("peak running", "peak_running", "{}"), ("mean running", "mean_running", "{:.1f}"),
    ("preemptions", "preemptions", "{:,}"), ("compressions", "compressions", "{:,}"),
    ("prompt tokens computed", "prefill_tokens", "{:,}"),
    ("prefix-hit tokens", "prefix_hit_tokens", "{:,}"),
    # Shown only for a deployment with a host tier (`HOST_ROWS`).
    ("  of them from host memory", "host_hit_tokens", "{:,}"),
    # The rest are a preempted request's own blocks found again.
    ("  of them at first admission", "first_hit_tokens", "{:,}"),
    ("host tier blocks copied", "host_copy_blocks", "{:,}"),
    ("max blocks after compression", "max_blocks_after_compress", "{}"),
    ("mean kept budget (tokens)", "mean_kept_budget", "{:,.0f}"),
    ("N_max (blocks per request)", "n_max", "{}"),
    # M bounds the requests that hold a query slot; hybrid scheduling runs more without one.
    ("query slots M", "max_concurrency", "{}"),
    ("KV blocks", "num_blocks", "{:,}"), ("host tier slots", "num_host_blocks", "{:,}"),
    ("steps", "steps", "{:,}"),
    ("wall time (s)", "wall_s", "{:.2f}"),
]

HOST_ROWS = ("host_hit_tokens", "host_copy_blocks", "num_host_blocks")


def run_status(summary: dict) -> int:
    """0 when every request completed, EXIT_REQUESTS_FAILED when any failed."""
    return EXIT_OK if summary["failed"] == 0 else EXIT_REQUESTS_FAILED


def describe_run(summary: dict) -> str:
    """One line naming the run: trace, model, driver, device and the knobs that shape it."""
    config = summary["settings"]["config"]
    if config["compress"]:
        mode = (f"budget {config['kv_budget']}, block {config['block_size']}, "
                f"{'hybrid' if config['hybrid'] else 'constrained'} scheduling")
    else:
        mode = f"Full KV (no compression), block {config['block_size']}"
    graphs = summary.get("graphs")
    if graphs is not None and summary["driver"] == "engine-cuda":
        graphed = [steps for steps in ("decode", "prefill") if graphs[steps]]
        mode += f", {' and '.join(graphed) if graphed else 'no'} CUDA graphs"
    return (f"{summary.get('trace', 'run')} on {summary['settings']['model']} · "
            f"{summary['driver']} on {summary['device']} · {mode}")


def print_summary(summary: dict, title: str | None = None) -> None:
    """The summary's rows under `title` (default: `describe_run`, which needs the run's
    settings; a served run has none). A simulated run, and only a simulated run, says how far to
    trust its figures: the validated band beside each one a validated profile priced, else one
    line that it has none (zipage/cli/bands.py)."""
    from zipage.cli.bands import band_note, summary_rows, validation_lines

    print(title or describe_run(summary))
    rows = summary_rows(SUMMARY_ROWS, summary)
    if not summary.get("num_host_blocks"):
        rows = [row for row in rows if row[1] not in HOST_ROWS]
    width = max(len(label) for label, _, _ in rows)
    validation = summary.get("validation")
    texts = ["-" if summary.get(key) is None else pattern.format(summary[key])
             for _, key, pattern in rows]
    notes = [band_note(validation, key) if validation else None for _, key, _ in rows]
    # The notes start in one column, after the widest figure that has one.
    figures = max((len(text) for text, note in zip(texts, notes) if note), default=0)
    for (label, _, _), text, note in zip(rows, texts, notes):
        print(f"  {label:<{width}}  " + (f"{text:<{figures}}  {note}" if note else text))
    # Only a simulation predicts: an engine run measured its figures (its summary's validation
    # is None, to keep the simulator's key set), so it has no band to lack.
    if summary.get("driver") == SIMULATOR:
        for line in validation_lines(summary):
            print(line)


def progress_wanted(args: argparse.Namespace) -> bool:
    """Progress bars only on a terminal: in a log file or a pipe their carriage returns and
    erasing spaces become lines of noise."""
    return not getattr(args, "no_progress", False) and sys.stderr.isatty()


def close_progress_bars() -> None:
    """Close any bar an error interrupted, so the error starts on a line of its own."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", None) or []):
        bar.close()
