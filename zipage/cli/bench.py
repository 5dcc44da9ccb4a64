"""`zipage bench serve`: replay a trace against a running OpenAI-compatible server in real time."""

from __future__ import annotations

import argparse
import json

from zipage.cli.flags import require_serve_extra
from zipage.cli.output import print_summary


def add_parser(commands) -> None:
    bench = commands.add_parser("bench", help="benchmarks against a running server")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    bench_serve = bench_commands.add_parser(
        "serve", help="replay a trace against an OpenAI-compatible server in real time")
    bench_serve.add_argument("trace", help="trace JSON (see docs/traces.md)")
    bench_serve.add_argument("--url", required=True, help="server, e.g. http://127.0.0.1:8000")
    bench_serve.add_argument("--model", default=None,
                             help="model name to send (default: the server's first model)")
    bench_serve.add_argument("--api-key", default=None)
    bench_serve.add_argument("--vocab-size", type=int, default=None, metavar="N",
                             help="vocabulary the synthetic prompt ids are drawn for (default "
                                  "32000: the same ids as `zipage replay` for any vocabulary "
                                  "of 32000 or more)")
    bench_serve.add_argument("--out", default=None,
                             help="directory for summary.json, requests.csv (steps.csv and "
                                  "decisions.log stay empty: only the server knows them)")
    bench_serve.add_argument("--json", action="store_true",
                             help="print exactly one JSON object (the summary) on stdout")
    bench_serve.add_argument("--no-progress", action="store_true")
    bench_serve.add_argument("--users", type=_users, default=None, metavar="N",
                             help="at most N sessions at once, each user starting the next "
                                  "session (in trace order) when its last one ended, as "
                                  "`zipage replay --users` (docs/traces.md, 'Sessions')")
    bench_serve.set_defaults(handler=cmd_bench_serve)


def _users(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 (sessions at once), got "
                                         f"{text!r}")
    return int(text)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    require_serve_extra()
    import asyncio

    from zipage.serve.bench import bench_serve
    from zipage.trace import DEFAULT_VOCAB_SIZE
    from zipage.trace_import import load_trace_file

    trace = load_trace_file(args.trace)
    summary, records = asyncio.run(bench_serve(
        trace, args.url, args.model, api_key=args.api_key,
        vocab_size=args.vocab_size or DEFAULT_VOCAB_SIZE,
        progress=not args.no_progress and not args.json, users=args.users))
    if args.out is not None:
        from zipage.rundir import write_run

        write_run(args.out, summary, [], records, [])
    if args.json:
        print(json.dumps(summary))
        return 0
    print_summary(summary, title=f"{trace.name} served by {summary['model']} at {args.url}")
    print_prefix_cache(summary)
    print_sessions(summary)
    for record in [record for record in records if record.error][:5]:
        print(f"  failed: {record.id}: {record.error}")
    if args.out is not None:
        print(f"wrote {args.out}/summary.json, requests.csv")
    return 0


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
