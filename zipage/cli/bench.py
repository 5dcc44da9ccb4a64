"""`zipage bench serve`: load-test a running OpenAI-compatible server in real time with a trace or
vLLM's random and sharegpt datasets, and report as `vllm bench serve` does (docs/serve.md)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from zipage.cli.flags import require_serve_extra
from zipage.cli.output import print_summary
from zipage.errors import ZipageError

# vLLM's `--backend` names and the endpoint each one means here.
BACKENDS = {"openai": "/v1/completions", "vllm": "/v1/completions",
            "openai-chat": "/v1/chat/completions"}
LATENCIES = ("ttft", "tpot", "itl", "e2el")
SECTIONS = {"ttft": ("Time to First Token", "TTFT"),
            "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
            "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


def add_parser(commands) -> None:
    bench = commands.add_parser("bench", help="benchmarks against a running server")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    bench_serve = bench_commands.add_parser(
        "serve", help="load-test an OpenAI-compatible server in real time (a trace, or vLLM's "
                      "random and sharegpt datasets)")
    bench_serve.add_argument("trace", nargs="?", default=None,
                             help="trace JSON (see docs/traces.md); the same as --dataset-name "
                                  "trace --dataset-path TRACE")
    bench_serve.add_argument("--url", "--base-url", dest="url", required=True,
                             help="server, e.g. http://127.0.0.1:8000")
    bench_serve.add_argument("--model", default=None,
                             help="model name to send (default: the server's first model)")
    bench_serve.add_argument("--api-key", default=None)
    workload = bench_serve.add_argument_group("workload (vLLM's dataset flags)")
    workload.add_argument("--dataset-name", default=None, metavar="NAME",
                          help="trace, random or sharegpt (default: trace with a trace file, "
                               "else random)")
    workload.add_argument("--dataset-path", default=None, metavar="FILE",
                          help="the trace, or the ShareGPT JSON file")
    workload.add_argument("--num-prompts", default=None, metavar="N",
                          help="requests to send (default: all of a trace; 1000 of a dataset)")
    workload.add_argument("--seed", default="0", metavar="N",
                          help="draws the random dataset, the ShareGPT sample and the "
                               "arrivals (default 0)")
    workload.add_argument("--tokenizer", default=None, metavar="PATH",
                          help="HF model directory or .gguf file: text datasets need it "
                               "(sharegpt; random sends text with it, token ids without)")
    workload.add_argument("--random-input-len", default="1024", metavar="N")
    workload.add_argument("--random-output-len", default="128", metavar="N")
    workload.add_argument("--random-range-ratio", default="0.0", metavar="R",
                          help="lengths uniform within +-R of the two above (0 <= R < 1)")
    workload.add_argument("--random-prefix-len", default="0", metavar="N",
                          help="tokens every random prompt starts with, the same for all")
    workload.add_argument("--sharegpt-output-len", default=None, metavar="N",
                          help="output length of every ShareGPT request (default: its gpt "
                               "turn's tokens)")
    workload.add_argument("--vocab-size", type=int, default=None, metavar="N",
                          help="vocabulary the synthetic prompt ids are drawn for (default "
                               "32000: the same ids as `zipage replay` for any vocabulary "
                               "of 32000 or more)")
    load = bench_serve.add_argument_group("load")
    load.add_argument("--request-rate", default=None, metavar="R",
                      help="requests per second, or inf (all at once); a trace keeps its own "
                           "arrivals unless given (its follow-up turns stay closed-loop). "
                           "Default inf for a dataset")
    load.add_argument("--burstiness", default="1.0", metavar="B",
                      help="gamma shape of the gaps between arrivals: 1 Poisson, below 1 "
                           "burstier, above 1 steadier (default 1)")
    load.add_argument("--max-concurrency", default=None, metavar="N",
                      help="at most N requests in flight; a request's clock starts when it "
                           "gets its place")
    load.add_argument("--users", type=_users, default=None, metavar="N",
                      help="at most N sessions at once, each user starting the next "
                           "session (in trace order) when its last one ended, as "
                           "`zipage replay --users` (docs/traces.md, 'Sessions')")
    load.add_argument("--endpoint", default=None, metavar="PATH",
                      help="/v1/completions (default) or /v1/chat/completions (text prompts)")
    load.add_argument("--backend", default=None, metavar="NAME",
                      help="vLLM's name for the endpoint: openai or vllm (completions), "
                           "openai-chat (chat)")
    report = bench_serve.add_argument_group("report")
    report.add_argument("--percentile-metrics", default="ttft,tpot,itl", metavar="LIST",
                        help="latencies reported, of ttft,tpot,itl,e2el (default "
                             "ttft,tpot,itl)")
    report.add_argument("--metric-percentiles", default="99", metavar="LIST",
                        help="their percentiles, e.g. 50,90,99 (default 99)")
    report.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                        help="service-level objectives, e.g. ttft:500 tpot:50 e2el:2000: "
                             "requests per second meeting all of them")
    report.add_argument("--save-result", action="store_true",
                        help="write vLLM's result JSON (--result-dir, --result-filename)")
    report.add_argument("--result-dir", default=None, metavar="DIR")
    report.add_argument("--result-filename", default=None, metavar="NAME")
    bench_serve.add_argument("--out", default=None,
                             help="directory for summary.json, requests.csv (steps.csv and "
                                  "decisions.log stay empty: only the server knows them)")
    bench_serve.add_argument("--json", action="store_true",
                             help="print exactly one JSON object (the summary) on stdout")
    bench_serve.add_argument("--no-progress", "--disable-tqdm", dest="no_progress",
                             action="store_true")
    bench_serve.set_defaults(handler=cmd_bench_serve)


def _users(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 (sessions at once), got "
                                         f"{text!r}")
    return int(text)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    require_serve_extra()
    import asyncio

    from zipage.serve.bench import ReportSpec, run_bench

    endpoint = _endpoint(args)
    rate = _number(args.request_rate, "--request-rate", "a number > 0 (requests per second) "
                   "or inf", lambda value: value > 0, allow_inf=True)
    burstiness = _number(args.burstiness, "--burstiness", "a number > 0 (the gamma shape)",
                         lambda value: value > 0)
    concurrency = _integer(args.max_concurrency, "--max-concurrency", 1)
    spec = ReportSpec(metrics=_metrics(args.percentile_metrics),
                      percentiles=_percentiles(args.metric_percentiles),
                      goodput=_goodput(args.goodput))
    if (args.result_dir or args.result_filename) and not args.save_result:
        raise ZipageError("--result-dir and --result-filename name the file --save-result "
                          "writes; add --save-result")
    if args.out is not None:
        from zipage.rundir import check_out_dir

        check_out_dir(args.out)
    workload, name, rate = _workload(args, rate, burstiness)
    result = asyncio.run(run_bench(
        workload.trace, args.url, args.model, api_key=args.api_key,
        vocab_size=args.vocab_size or _default_vocab(), texts=workload.texts,
        endpoint=endpoint, max_concurrency=concurrency, report=spec,
        progress=not args.no_progress and not args.json, users=args.users))
    summary, records = result.summary, result.records
    # The rate as vLLM's result JSON writes it: "inf" (JSON has no infinity); None: a trace's
    # own arrivals.
    summary["bench"].update(dataset=name, endpoint=endpoint,
                            request_rate="inf" if rate == float("inf") else rate,
                            burstiness=burstiness, max_concurrency=concurrency)
    if args.out is not None:
        from zipage.rundir import write_run

        write_run(args.out, summary, [], records, [])
    saved = _save_result(args, result, name, endpoint) if args.save_result else None
    if args.json:
        print(json.dumps(summary))
        return 0
    print_summary(summary, title=f"{workload.trace.name} served by {summary['model']} at "
                                 f"{args.url}")
    print_prefix_cache(summary)
    print_server_ttft(summary)
    print_sessions(summary)
    print_bench_report(summary["bench"], spec)
    for record in [record for record in records if record.error][:5]:
        print(f"  failed: {record.id}: {record.error}")
    if saved is not None:
        print(f"wrote {saved}")
    if args.out is not None:
        print(f"wrote {args.out}/summary.json, requests.csv")
    return 0


def _default_vocab() -> int:
    from zipage.trace import DEFAULT_VOCAB_SIZE

    return DEFAULT_VOCAB_SIZE


def _endpoint(args: argparse.Namespace) -> str:
    from zipage.serve.bench import COMPLETIONS, ENDPOINTS

    if args.backend is not None and args.backend not in BACKENDS:
        raise ZipageError(f"--backend: expected one of {', '.join(BACKENDS)}, got "
                          f"{args.backend!r}")
    if args.endpoint is not None and args.endpoint not in ENDPOINTS:
        raise ZipageError(f"--endpoint: expected one of {', '.join(ENDPOINTS)}, got "
                          f"{args.endpoint!r}")
    if args.backend is not None and args.endpoint is not None \
            and BACKENDS[args.backend] != args.endpoint:
        raise ZipageError(f"--backend {args.backend} sends to {BACKENDS[args.backend]}, not "
                          f"--endpoint {args.endpoint}; give one of the two")
    return args.endpoint or BACKENDS.get(args.backend, COMPLETIONS)


def _workload(args: argparse.Namespace, rate: float | None, burstiness: float):
    """The requests to send, by the dataset flags, the dataset's name and the request rate
    they were timed at (None: a trace's own arrivals)."""
    from zipage.serve import bench_data

    name = args.dataset_name or ("trace" if args.trace or args.dataset_path else "random")
    if name not in bench_data.DATASETS:
        raise ZipageError(f"--dataset-name: expected one of {', '.join(bench_data.DATASETS)}, "
                          f"got {name!r}")
    if args.trace and args.dataset_path and args.trace != args.dataset_path:
        raise ZipageError("a trace file and --dataset-path both given; give one of the two")
    path = args.dataset_path or args.trace
    if args.trace and name != "trace":
        raise ZipageError(f"--dataset-name {name}: a trace file was given too; pass the "
                          "dataset's file as --dataset-path")
    seed = _integer(args.seed, "--seed", 0)
    num_prompts = _integer(args.num_prompts, "--num-prompts", 1)
    if name == "trace":
        if path is None:
            raise ZipageError("--dataset-path: --dataset-name trace needs the trace file "
                              "(--dataset-path FILE, or FILE as the first argument)")
        from zipage.trace_import import load_trace_file

        workload = bench_data.trace_workload(load_trace_file(path), num_prompts)
    else:
        if path is None and name == "sharegpt":
            raise ZipageError("--dataset-path: --dataset-name sharegpt needs the ShareGPT JSON "
                              "file (--dataset-path FILE)")
        if path is not None and name == "random":
            raise ZipageError("--dataset-path: the random dataset reads no file; drop it, or "
                              "pick --dataset-name trace or sharegpt")
        if name == "sharegpt" and args.tokenizer is None:
            raise ZipageError("--tokenizer: the sharegpt dataset is text, and its prompt and "
                              "output lengths are counted in tokens; pass the served model's "
                              "tokenizer (a HF model directory or .gguf file)")
        tokenizer = (bench_data.load_bench_tokenizer(args.tokenizer)
                     if args.tokenizer is not None else None)
        count = num_prompts or bench_data.DEFAULT_NUM_PROMPTS
        if name == "random":
            spec = bench_data.RandomSpec(
                input_len=_integer(args.random_input_len, "--random-input-len", 1),
                output_len=_integer(args.random_output_len, "--random-output-len", 1),
                range_ratio=_number(args.random_range_ratio, "--random-range-ratio",
                                    "a number with 0 <= R < 1", lambda value: 0 <= value < 1),
                prefix_len=_integer(args.random_prefix_len, "--random-prefix-len", 0))
            workload = bench_data.random_workload(spec, count, seed, tokenizer,
                                                  args.vocab_size or _default_vocab())
        else:
            workload = bench_data.sharegpt_workload(
                path, count, seed, tokenizer,
                _integer(args.sharegpt_output_len, "--sharegpt-output-len", 1))
    if name != "trace" and rate is None:
        rate = float("inf")  # vLLM's default: every request at once
    if rate is not None:
        workload = bench_data.Workload(bench_data.retime(workload.trace, rate, burstiness, seed),
                                       workload.texts)
    return workload, name, rate


def _number(text: str | None, flag: str, expected: str, valid, allow_inf: bool = False):
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or value != value or (value == float("inf") and not allow_inf) \
            or not valid(value):
        raise ZipageError(f"{flag}: expected {expected}, got {text!r}")
    return value


def _integer(text: str | None, flag: str, low: int) -> int | None:
    if text is None:
        return None
    if not text.strip().isdigit() or int(text) < low:
        raise ZipageError(f"{flag}: expected an integer >= {low}, got {text!r}")
    return int(text)


def _metrics(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(","))
    bad = [name for name in names if name not in LATENCIES]
    if bad or not names:
        raise ZipageError(f"--percentile-metrics: expected a comma list of "
                          f"{', '.join(LATENCIES)}, got {text!r}")
    return tuple(dict.fromkeys(names))


def _percentiles(text: str) -> tuple[float, ...]:
    values = []
    for part in text.split(","):
        value = _number(part.strip(), "--metric-percentiles",
                        f"a comma list of percentiles in (0, 100], e.g. 50,90,99 (in {text!r})",
                        lambda value: 0 < value <= 100)
        values.append(value)
    return tuple(dict.fromkeys(values))


def _goodput(items: list[str] | None) -> dict[str, float] | None:
    if items is None:
        return None
    slos = {}
    for item in items:
        key, _, limit = item.partition(":")
        if key not in GOODPUT_KEYS:
            raise ZipageError(f"--goodput: expected KEY:MS with KEY one of "
                              f"{', '.join(GOODPUT_KEYS)}, got {item!r}")
        slos[key] = _number(limit, "--goodput", f"KEY:MS with MS a number > 0, e.g. {key}:500 "
                            f"(in {item!r})", lambda value: value > 0)
    return slos


def _save_result(args: argparse.Namespace, result, dataset: str, endpoint: str) -> Path:
    """vLLM's result JSON: the run's settings, its report, and per request the input and
    output lengths, TTFT, ITLs (s) and error of each."""
    import time

    bench = result.summary["bench"]
    backend = "openai-chat" if endpoint == BACKENDS["openai-chat"] else (args.backend or "openai")
    rate = bench["request_rate"]
    concurrency = bench["max_concurrency"]
    model = str(result.summary["model"])
    name = args.result_filename or (
        f"{backend}-{'trace' if rate is None else 'infqps' if rate == 'inf' else f'{rate:g}qps'}"
        + (f"-concurrency{concurrency}" if concurrency else "")
        + f"-{Path(model).name}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    path = Path(args.result_dir or ".") / name
    done = [record for record in result.records if record.status == "finished"]
    data = {
        "date": time.strftime("%Y%m%d-%H%M%S"), "backend": backend, "endpoint": endpoint,
        "model_id": model, "tokenizer_id": args.tokenizer, "dataset_name": dataset,
        "num_prompts": len(result.records),
        "request_rate": rate,
        "burstiness": bench["burstiness"], "max_concurrency": concurrency,
        **{key: value for key, value in bench.items()
           if key not in ("dataset", "endpoint", "request_rate", "burstiness",
                          "max_concurrency")},
        "input_lens": [record.prompt_len for record in done],
        "output_lens": [record.output_len for record in done],
        "ttfts": [record.first_token - record.arrival for record in done],
        "itls": [result.timings[record.id].itls() for record in done],
        "errors": [record.error or "" for record in result.records],
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1))
    except OSError as error:
        raise ZipageError(f"--result-dir: cannot write {path} ({error.strerror or error})") \
            from None
    return path


def print_bench_report(report: dict, spec) -> None:
    """The report in `vllm bench serve`'s layout."""
    from zipage.serve.bench import percent_name

    def row(label: str, value) -> None:
        print(f"{label:<40} {value:<10}")

    print(f"{' Serving Benchmark Result ':=^50}")
    row("Successful requests:", report["completed"])
    row("Failed requests:", report["failed"])
    if report.get("max_concurrency"):
        row("Maximum request concurrency:", report["max_concurrency"])
    row("Peak concurrent requests:", report["max_concurrent_requests"])
    row("Benchmark duration (s):", f"{report['duration']:.2f}")
    row("Total input tokens:", report["total_input_tokens"])
    row("Total generated tokens:", report["total_output_tokens"])
    row("Request throughput (req/s):", f"{report['request_throughput']:.2f}")
    if report["request_goodput"] is not None:
        row("Request goodput (req/s):", f"{report['request_goodput']:.2f}")
    row("Output token throughput (tok/s):", f"{report['output_throughput']:.2f}")
    row("Total Token throughput (tok/s):", f"{report['total_token_throughput']:.2f}")
    for metric in spec.metrics:
        title, short = SECTIONS[metric]
        print(f"{title:-^50}")
        row(f"Mean {short} (ms):", f"{report[f'mean_{metric}_ms']:.2f}")
        row(f"Median {short} (ms):", f"{report[f'median_{metric}_ms']:.2f}")
        for percent in spec.percentiles:
            name = percent_name(percent)
            row(f"P{name} {short} (ms):", f"{report[f'p{name}_{metric}_ms']:.2f}")
    print("=" * 50)


def print_prefix_cache(summary: dict) -> None:
    """The run's prompt tokens served from the prefix cache (its responses' `cached_tokens`),
    and the server's /metrics figures over the run beside them where it has them."""
    hits = summary.get("prefix_hit_tokens")
    line = ("  prefix cache: the server reports no cached_tokens" if hits is None else
            f"  prefix cache: {hits:,} prompt tokens of the responses from the cache "
            f"({100 * summary['prefix_hit_share']:.1f} % of their prompt tokens)")
    if summary.get("server_prefix_hit_tokens") is not None:
        line += (f"; /metrics over the run: {summary['server_prefix_hit_tokens']:,} hit, "
                 f"{summary['prefill_tokens']:,} computed")
    print(line)


# The client's mean TTFT this far (and this many times) beyond the server's own says the HTTP path
# (the server's event loop or this client's), not the engine, made most of it.
HTTP_TTFT_NOTE_S, HTTP_TTFT_NOTE_RATIO = 0.05, 2.0


def print_server_ttft(summary: dict) -> None:
    """The server's own mean TTFT (its /metrics histogram over the run) beside this client's, and
    a note when the HTTP path added most of what the client measured."""
    server, client = summary.get("server_ttft_mean_s"), summary.get("mean_ttft_s")
    if server is None or not client:
        return
    print(f"  TTFT at the server (its /metrics, mean): {1000 * server:.1f} ms; "
          f"at this client: {1000 * client:.1f} ms")
    if client - server > HTTP_TTFT_NOTE_S and client > HTTP_TTFT_NOTE_RATIO * server:
        print(f"  note: {1000 * (client - server):.0f} ms a request on average came on the HTTP "
              "path, outside the server's own span: at high token rates one Python event loop "
              "on each side (the server's, this client's) saturates; docs/serve.md, 'Benchmark "
              "a server'")


def print_sessions(summary: dict) -> None:
    """A trace with sessions: its follow-ups, and each turn's latencies (turn 1: the requests
    that follow none)."""
    if not summary.get("follow_ups"):
        return
    from zipage.serve.bench import LATE_S

    print(f"  sessions: {summary['follow_ups']} follow-up turns, "
          f"{summary['follow_ups_failed']} failed ({summary['follow_ups_not_sent']} not sent: "
          f"the turn they follow failed); {summary['sent_late']} requests sent over "
          f"{LATE_S * 1000:.0f} ms late (max {summary['max_send_lag_s'] * 1000:.1f} ms)")
    print("  turn  requests  completed  failed  TTFT p50/p90 (s)  e2e p50/p90 (s)  "
          "TPOT p50 (ms)  tok/s")
    for turn in summary["turns"]:
        print(f"  {turn['turn']:>4}  {turn['requests']:>8}  {turn['completed']:>9}  "
              f"{turn['failed']:>6}  {turn['ttft_p50_s']:>7.3f} / {turn['ttft_p90_s']:<6.3f}  "
              f"{turn['e2e_p50_s']:>6.3f} / {turn['e2e_p90_s']:<6.3f}  "
              f"{turn['tpot_p50_ms']:>13.2f}  {turn['tps']:,.1f}")
