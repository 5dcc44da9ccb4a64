"""`zipage trace make` and `zipage trace import`: workload traces, generated or converted from production formats."""

from __future__ import annotations

import argparse
from pathlib import Path

from zipage.errors import ZipageError


def add_parser(commands) -> None:
    trace = commands.add_parser("trace", help="make workload traces")
    trace_commands = trace.add_subparsers(dest="trace_command", required=True)
    make = trace_commands.add_parser("make", help="generate a workload trace")
    from zipage.session_workloads import SESSION_OPTIONS
    from zipage.workloads import ALL_WORKLOADS

    make.add_argument("kind", help=f"{', '.join(ALL_WORKLOADS)} - or a trace .json to re-stamp "
                                   "with arrivals (docs/traces.md)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("-o", "--output", required=True,
                      help="the trace to write: .json, or .jsonl (JSON Lines), optionally .gz")
    make.add_argument("--rate", type=float, default=None,
                      help="stamp online arrivals at this many requests per second")
    make.add_argument("--arrivals", choices=["poisson", "bursty"], default="poisson")
    make.add_argument("--burst-size", type=int, default=8)
    sessions = make.add_argument_group(
        "session shapes", "flags of chat-sessions, agent-sessions and research-sessions; their "
                          "defaults and sources: docs/traces.md, 'Session shapes'")
    for option in SESSION_OPTIONS.values():
        # Taken as text and parsed by the option, so a bad value is one line naming the flag.
        sessions.add_argument(option.flag, dest=f"session_{option.name}", default=None,
                              metavar="N" if option.kind is int else "X", help=option.meaning)
    make.set_defaults(handler=cmd_trace_make)
    from zipage.trace_import import FORMATS

    imported = trace_commands.add_parser(
        "import", help="turn a production trace (Azure, Mooncake, BurstGPT, Copilot agent "
                       "sessions, a ServeGen client pool) into a Zipage trace",
        description="Read a production trace and write a Zipage trace (docs/traces.md, "
                    "'Production traces'). A .jsonl.gz output is the compact large-trace form.")
    imported.add_argument("format", choices=FORMATS)
    imported.add_argument("file", help="the production trace (CSV or JSON Lines, optionally .gz; "
                                       "servegen: a model directory such as "
                                       "data/reason/deepseek-r1)")
    imported.add_argument("-o", "--output", required=True,
                          help="the trace to write: .json, .jsonl or .jsonl.gz")
    # --window, its first name, stays an alias: `zipage replay --window` is the compression
    # window (tokens), a different thing.
    imported.add_argument("--span", "--window", dest="window", default=None,
                          metavar="START:DURATION",
                          help="only requests arriving in this span from the first one, e.g. "
                               "0:3600 or 2h:30m (--window: the same, its former name)")
    imported.add_argument("--speedup", type=float, default=1.0, metavar="X",
                          help="compress time: arrivals X times closer together (default 1)")
    imported.add_argument("--sample", type=float, default=1.0, metavar="P",
                          help="keep each request with probability P (default 1: all)")
    imported.add_argument("--seed", type=int, default=0,
                          help="seed of --sample (servegen: of every draw)")
    imported.add_argument("--max-model-len", type=int, default=None, metavar="N",
                          help="drop requests whose prompt + output exceed N tokens (counted)")
    imported.add_argument("--name", default=None, help="the trace's name (default: the file's)")
    imported.add_argument("--sessions", action="store_true",
                          help="mooncake: infer sessions from the hash chains (a request whose "
                               "hash ids begin with an earlier prompt's follows it, closed "
                               "loop); copilot records are always sessions")
    imported.add_argument("--assumed-ttft", type=float, default=None, metavar="S",
                          help="mooncake --sessions: the predecessor's assumed time to first "
                               "token, taken off the arrival gap to estimate after_s (default 1)")
    imported.add_argument("--assumed-tpot", type=float, default=None, metavar="S",
                          help="mooncake --sessions: the predecessor's assumed time per further "
                               "output token (default 0.03)")
    imported.set_defaults(handler=cmd_trace_import)


def cmd_trace_make(args: argparse.Namespace) -> int:
    from zipage.session_workloads import SESSION_OPTIONS
    from zipage.trace import save_trace, stamp_arrivals
    from zipage.trace_import import load_trace_file
    from zipage.workloads import ALL_WORKLOADS, make_trace

    source = Path(args.kind)
    given = {name: text for name in SESSION_OPTIONS
             if (text := getattr(args, f"session_{name}")) is not None}
    # A workload's name makes it; an existing file is a trace to re-stamp (any layout).
    if args.kind in ALL_WORKLOADS or not source.is_file():
        trace = make_trace(args.kind, args.seed, **_session_arguments(args.kind, given))
    else:
        if given:
            flag = SESSION_OPTIONS[next(iter(given))].flag
            raise ZipageError(f"{flag} shapes a generated session workload, but {args.kind} is "
                              f"a trace file to re-stamp; drop {flag}")
        trace = load_trace_file(source)
    if args.rate is not None:
        trace = stamp_arrivals(trace, args.rate, pattern=args.arrivals, seed=args.seed,
                               burst_size=args.burst_size)
    output = Path(args.output)
    if output.is_dir():
        raise ZipageError(f"-o: {output} is a directory; give the trace file to write, e.g. "
                          f"{output / 'trace.json'}")
    output.parent.mkdir(parents=True, exist_ok=True)
    save_trace(trace, output)
    print(f"wrote {args.output}: {len(trace.requests)} requests")
    return 0


def _session_arguments(kind: str, given: dict[str, str]) -> dict[str, int | float]:
    """The session flags given, as the generator's keyword arguments: each parsed and checked
    by its option; a flag the kind does not take is one line naming the kinds that do."""
    import inspect

    from zipage.session_workloads import SESSION_OPTIONS, SESSION_WORKLOADS
    from zipage.workloads import ALL_WORKLOADS

    if kind not in ALL_WORKLOADS:
        return {}  # make_trace names the kinds it knows
    accepted = inspect.signature(ALL_WORKLOADS[kind]).parameters
    arguments = {}
    for name, text in given.items():
        option = SESSION_OPTIONS[name]
        if name not in accepted:
            takers = [shape for shape, generator in SESSION_WORKLOADS.items()
                      if name in inspect.signature(generator).parameters]
            raise ZipageError(f"{option.flag} does not apply to {kind}: it shapes "
                              f"{', '.join(takers)}; drop {option.flag} or make one of those")
        arguments[name] = option.parse(text)
    return arguments


def cmd_trace_import(args: argparse.Namespace) -> int:
    from zipage.trace_import import ImportOptions, import_trace_file, parse_window

    output = Path(args.output)
    if output.is_dir():
        raise ZipageError(f"-o: {output} is a directory; give the trace file to write, e.g. "
                          f"{output / 'trace.jsonl.gz'}")
    options = ImportOptions(
        window=parse_window(args.window) if args.window is not None else None,
        speedup=args.speedup, sample=args.sample, seed=args.seed,
        max_model_len=args.max_model_len, name=args.name)
    from zipage.session_import import import_sessions_file, session_options, uses_sessions

    sessions = session_options(args.format, args.sessions, args.assumed_ttft, args.assumed_tpot)
    output.parent.mkdir(parents=True, exist_ok=True)
    if uses_sessions(args.format, sessions):  # sessions: grouped, each turn after its first
        report = import_sessions_file(args.format, args.file, output, options, sessions)
    else:
        report = import_trace_file(args.format, args.file, output, options)  # rows in, lines out
    print("\n".join(report.lines()))
    print(f"wrote {args.output}: {report.imported:,} requests")
    return 0
