"""`zipage serve`: an OpenAI-compatible HTTP server over the real engine (docs/serve.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zipage.cli.flags import (
    add_engine_flags,
    add_graph_flags,
    add_threads_flag,
    declared_default,
    engine_given,
    require_serve_extra,
    require_torch,
    settings_from_args,
)
from zipage.core.routing import LEAST_LOADED, ROUTING_POLICIES
from zipage.errors import ZipageError
from zipage.serve import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_LOG_STATS_INTERVAL_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    TWIN_NUM_CPUS,
)
from zipage.serve.reasoning import REASONING_PARSERS
from zipage.serve.tokenizer import TokenizerSource
from zipage.serve.tool_parsers import TOOL_PARSERS


def add_parser(commands) -> None:
    serve = commands.add_parser(
        "serve", help="an OpenAI-compatible HTTP server over the real engine (docs/serve.md)")
    add_engine_flags(serve)
    serve.set_defaults(model=None, handler=cmd_serve)
    for action in serve._actions:
        if action.dest == "model":  # no preset default: a server serves the model it is given
            action.help = "HF model directory, .gguf file or random:<preset> (required)"
        elif action.dest in REFUSED_FLAGS:  # refused by `_check_serve_flags`, so not listed
            action.default, action.help = None, argparse.SUPPRESS
    serve.add_argument("--engine", choices=["gpu", "cpu"], default=None,
                       help="run on the GPU (default) or on the CPU (small models; "
                            "--kv-memory-gb defaults to 1)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-waiting", type=int, default=None, metavar="N",
                       help="refuse a request with 429 while N requests wait for their first "
                            "token (default: no limit)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1/ routes (visible in "
                            "ps: prefer --api-key-file or $ZIPAGE_API_KEY)")
    serve.add_argument("--api-key-file", default=None, metavar="PATH",
                       help="read the API key from the first line of this file")
    serve.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                       metavar="N", help="refuse a request body larger than N bytes with 413 "
                                         f"(default {DEFAULT_MAX_BODY_BYTES}, 8 MiB)")
    serve.add_argument("--served-model-name", default=None,
                       help="the name clients use (default: the last part of --model)")
    serve.add_argument("--max-engine-restarts", type=int, default=3, metavar="N",
                       help="restart an engine process that dies at most N times within 10 "
                            "minutes, then exit 1 for a supervisor to restart the server "
                            "(default 3; 0: exit at the first death)")
    serve.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="on SIGTERM or SIGINT, wait at most this long for the requests in "
                            "flight, then fail the rest and exit (default 30)")
    serve.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                       metavar="SECONDS",
                       help="close a connection that has not sent a request's headers this "
                            "long after it opened or after its last response "
                            f"(default {DEFAULT_HEADER_TIMEOUT_S:g})")
    serve.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                       metavar="SECONDS",
                       help="answer 408 and close a connection whose request body is not "
                            "complete this long after its headers "
                            f"(default {DEFAULT_BODY_TIMEOUT_S:g})")
    serve.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                       metavar="N",
                       help="answer 503 and close a connection opened while N are open "
                            f"(default {DEFAULT_MAX_CONNECTIONS})")
    serve.add_argument("--keep-alive-timeout", type=float, default=5.0, metavar="SECONDS",
                       help="close an idle keep-alive connection after this long (default 5)")
    logs = serve.add_argument_group("logs on stderr (docs/serve.md, 'Logs')")
    logs.add_argument("--disable-access-log", "--disable-uvicorn-access-log",
                      dest="disable_access_log", action="store_true",
                      help="no line per request (method, path, status, latency, id, tokens); "
                           "the second name is vLLM's")
    logs.add_argument("--disable-log-stats", action="store_true",
                      help="no periodic stats line (throughput, queues, KV cache use, "
                           "prefix-cache hit rate)")
    logs.add_argument("--log-stats-interval", type=float, default=DEFAULT_LOG_STATS_INTERVAL_S,
                      metavar="SECONDS",
                      help="seconds between stats lines, printed only while the server works "
                           f"(default {DEFAULT_LOG_STATS_INTERVAL_S:g})")
    chat = serve.add_argument_group(
        "tool calling and reasoning (docs/serve.md, 'Tool calling and reasoning')")
    chat.add_argument("--enable-auto-tool-choice", action="store_true",
                      help="serve tool_choice \"auto\": the output is searched for tool calls "
                           "(needs --tool-call-parser)")
    chat.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                      help="the format of the model's tool calls: hermes (Qwen2.5, Qwen3, "
                           "Hermes: <tool_call> blocks), llama3_json (Llama 3.1/3.2 JSON calls)")
    chat.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                      help="split the <think> reasoning of a thinking model into "
                           "reasoning_content: qwen3, deepseek_r1 (the template opens <think>)")
    chat.add_argument("--chat-template", default=None, metavar="PATH",
                      help="a Jinja chat template file used instead of the model's own (e.g. "
                           "one that renders tools)")
    parallel = serve.add_argument_group("replicas (docs/serve.md, 'Data parallel')")
    parallel.add_argument("--data-parallel", type=int, default=1, metavar="N",
                          help="serve N engine replicas behind this one server: one engine "
                               "process per GPU (per --tensor-parallel GPUs) or per slice of the "
                               "CPU cores (default 1)")
    parallel.add_argument("--routing", choices=ROUTING_POLICIES, default=LEAST_LOADED,
                          help="how requests are spread over the replicas, by the rules "
                               "`zipage plan --routing` simulates (default least-loaded)")
    parallel.add_argument("--ray", default=None, metavar="ADDRESS",
                          help="run the replicas as Ray Serve deployments on the Ray cluster at "
                               "ADDRESS ('auto', 'ray://HOST:10001', or 'local' for a new local "
                               "instance): Ray places one replica per GPU (or CPU; with "
                               f"--simulate, a twin asks for {TWIN_NUM_CPUS:g} CPU) and replaces "
                               "one that dies; the OpenAI app is the ingress on --host/--port")
    add_graph_flags(serve)
    add_threads_flag(serve)
    twin = serve.add_argument_group("a GPU-free twin (docs/serve.md, 'A GPU-free twin server')")
    twin.add_argument("--simulate", action="store_true",
                      help="serve from the simulator's twin stepping in real time instead of the "
                           "engine (no GPU, no torch): each step lasts what the cost model says "
                           "on the simulated GPU, taken from --hardware and --cost-model as "
                           "`zipage replay` takes them; tokens come from a cheap generator and "
                           "every request runs to its max_tokens")
    twin.add_argument("--tokenizer", default=None, metavar="PATH",
                      help="--simulate: the tokenizer of this HF model directory or .gguf file, "
                           "for text prompts (default: --model's when it is a path; with a "
                           "preset, prompts are token ids)")


API_KEY_VARIABLE = "ZIPAGE_API_KEY"
# Deployment flags a server has no use for, and why: the simulator's (`zipage replay` without
# --gpu, `zipage plan`: the GPU it prices and its cost model; a server runs on the device it has),
# and a trace replay's closed population (a server serves whatever its clients send).
_SIMULATOR = ("a simulator flag (zipage replay, zipage plan); zipage serve runs the real engine on "
              "the device it has unless --simulate (the twin then prices its steps with it): "
              "add --simulate or drop it")
# What --simulate takes of those: the GPU it prices and its cost model.
SIMULATE_FLAGS = ("hardware", "cost_model")
# The engine's own flags, which the twin has no use for: dest -> flag.
ENGINE_ONLY_FLAGS = {"engine": "--engine", "threads": "--threads",
                     "no_cuda_graphs": "--no-cuda-graphs", "prefill_graphs": "--prefill-graphs"}
REFUSED_FLAGS = {"hardware": ("--hardware", _SIMULATOR), "cost_model": ("--cost-model", _SIMULATOR),
                   "users": ("--users", "a trace replay's closed population (zipage replay, zipage "
                             "bench serve --users); a server serves what its clients send: drop it")}


def api_key_from(args: argparse.Namespace, environ) -> str | None:
    """The key from --api-key, --api-key-file or $ZIPAGE_API_KEY (one of them, in that order of
    precedence for the flags; the variable only when neither flag is given)."""
    if args.api_key is not None and args.api_key_file is not None:
        raise ZipageError("--api-key and --api-key-file: give one of them")
    if args.api_key_file is not None:
        try:
            lines = Path(args.api_key_file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise ZipageError(f"--api-key-file: cannot read {args.api_key_file}: "
                              f"{getattr(error, 'strerror', None) or error}") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise ZipageError(f"--api-key-file: {args.api_key_file} is empty; put the key on "
                              "its first line")
        return key
    if args.api_key is not None:
        key = args.api_key
    else:
        key = environ.get(API_KEY_VARIABLE)
        if key is None:
            return None
    if not key.strip():
        raise ZipageError(f"{'--api-key' if args.api_key is not None else API_KEY_VARIABLE}: "
                          "empty; give a key or leave it out")
    return key.strip()


def _check_serve_flags(args: argparse.Namespace) -> str | None:
    """Every serve flag checked before anything loads; returns the API key, if any."""
    if args.model is None:
        raise ZipageError("--model: required; a HF model directory, a .gguf file or "
                          "random:<preset>")
    for dest, (flag, why) in REFUSED_FLAGS.items():
        if args.simulate and dest in SIMULATE_FLAGS:
            pass
        elif getattr(args, dest) is not None:
            raise ZipageError(f"{flag}: {why}")
        if getattr(args, dest) is None:
            setattr(args, dest, declared_default(dest))  # what the settings record
    _check_simulate_flags(args)
    _check_chat_flags(args)
    if args.max_waiting is not None and args.max_waiting < 1:
        raise ZipageError(f"--max-waiting: got {args.max_waiting}, expected >= 1")
    if args.max_body_bytes < 1:
        raise ZipageError(f"--max-body-bytes: got {args.max_body_bytes}, expected >= 1")
    if args.max_connections < 1:
        raise ZipageError(f"--max-connections: got {args.max_connections}, expected >= 1")
    if args.data_parallel < 1:
        raise ZipageError(f"--data-parallel: got {args.data_parallel}, expected >= 1 replicas")
    if getattr(args, "async_scheduling", False) and args.simulate:
        raise ZipageError("--async-scheduling: the served twin (--simulate) steps synchronously "
                          "for now: drop it, or serve the engine")
    if args.max_engine_restarts < 0:
        raise ZipageError(f"--max-engine-restarts: got {args.max_engine_restarts}, "
                          "expected >= 0")
    for flag in ("drain_timeout", "header_timeout", "body_timeout", "keep_alive_timeout",
                 "log_stats_interval"):
        value = getattr(args, flag)
        if not value > 0:
            raise ZipageError(f"--{flag.replace('_', '-')}: got {value}, expected seconds > 0")
    import os

    return api_key_from(args, os.environ)


def _check_simulate_flags(args: argparse.Namespace) -> None:
    """The engine's own flags are refused with --simulate, and --tokenizer without it."""
    if not args.simulate:
        if args.tokenizer is not None:
            raise ZipageError("--tokenizer: only with --simulate (the engine serves its "
                              "--model's own tokenizer): add --simulate or drop it")
        return
    for dest, flag in ENGINE_ONLY_FLAGS.items():
        if getattr(args, dest) not in (None, False):
            raise ZipageError(f"{flag}: an engine flag; --simulate runs no engine (each step "
                              "lasts what --cost-model says on --hardware): drop it")


def _check_chat_flags(args: argparse.Namespace) -> None:
    """The tool-calling flags go together; --chat-template is read (and parsed) now."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ZipageError("--enable-auto-tool-choice: needs --tool-call-parser NAME "
                          f"({', '.join(sorted(TOOL_PARSERS))})")
    args.chat_template_text = None
    if args.chat_template is None:
        return
    try:
        text = Path(args.chat_template).read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ZipageError(f"--chat-template: cannot read {args.chat_template}: "
                          f"{getattr(error, 'strerror', None) or error}") from None
    try:
        import jinja2
    except ImportError:  # transformers brings it, and renders the template with it
        raise ZipageError("--chat-template: needs jinja2 (pip install 'zipage[engine]')") from None
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as error:
        raise ZipageError(f"--chat-template: {args.chat_template} line {error.lineno}: "
                          f"{error.message}") from None
    args.chat_template_text = text


def _chat_options(args: argparse.Namespace) -> dict:
    """`build_app`'s chat settings, from the tool-calling and reasoning flags."""
    from zipage.serve.chat_output import ChatSettings

    return {"chat": ChatSettings(args.tool_call_parser, args.enable_auto_tool_choice,
                                 args.reasoning_parser, args.chat_template_text)}


def cmd_serve(args: argparse.Namespace) -> int:
    api_key = _check_serve_flags(args)
    require_serve_extra()
    if not args.simulate:  # the twin needs neither torch nor a GPU
        given = engine_given(args)
        require_torch(args.engine, given, "use --engine cpu (small models)")
    if args.ray is not None:
        return _serve_on_ray(args, api_key)
    from zipage.serve.listen import bind

    try:  # before the model loads: a taken or impossible port is an error at once
        sock = bind(args.host, args.port)
    except ValueError as error:
        raise ZipageError(str(error)) from None
    with sock:
        return _serve(args, sock, api_key)


def _serve(args: argparse.Namespace, sock, api_key: str | None) -> int:
    from zipage.serve.engine_client import EngineProcessError
    from zipage.serve.replicas import ReplicaSet, replica_setups

    settings = settings_from_args(args)
    source = _tokenizer_source(args, settings)
    # The twin's tokenizer first: the twin must know its special tokens, never to make one.
    tokenizer = source.load() if args.simulate else None
    setup = _engine_setup(args, settings, tokenizer)
    setups = replica_setups(setup, args.data_parallel, settings.tensor_parallel)
    # Each engine runs in a process of its own (docs/serve.md, 'How it works'); the server
    # listens only once every replica has loaded the model.
    try:
        engine = ReplicaSet.start(setups, args.max_engine_restarts, args.routing)
    except EngineProcessError as error:
        print(f"zipage: error: {error}", file=sys.stderr)
        return 1
    try:
        if not args.simulate:
            tokenizer = source.load()  # this process detokenizes
        name = args.served_model_name or Path(settings.model).name  # a path's last part
        server = _http_server(args, engine, tokenizer, name, api_key)
        info, capacity = engine.info, engine.info.capacity
        threads = (f", {info.threads} torch thread{'s' * (info.threads != 1)}"
                   if info.threads is not None else "")
        pids = engine.pids
        where = (f"engine process {pids[0]}" if len(pids) == 1 else
                 f"{len(pids)} replicas routed {args.routing} (engine processes "
                 f"{', '.join(map(str, pids))}), each")
        print(f"zipage serve: {name} on {info.device} ({settings.dtype}{threads}), {where} "
              f"with {capacity.num_blocks} KV blocks of {info.config.block_size} tokens and "
              f"{capacity.num_query_slots} query slots; listening on "
              f"http://{args.host}:{args.port}", file=sys.stderr, flush=True)
        server.run(sockets=[sock])
    finally:
        engine.stop_process()
    return _serve_status(server, engine)


def _serve_on_ray(args: argparse.Namespace, api_key: str | None) -> int:
    """Deploy on Ray Serve (zipage/serve/ray_serve.py) and wait for SIGINT or SIGTERM."""
    import os
    import signal
    import threading

    try:
        import ray
        from ray import serve
    except ImportError:
        raise ZipageError("--ray: Ray Serve is not installed; pip install 'zipage[ray]'") from None
    from zipage.serve.ray_connect import LOCAL, connect
    from zipage.serve.ray_serve import deploy

    settings = settings_from_args(args)
    source = _tokenizer_source(args, settings)
    # The twin's tokenizer here too (its special tokens, which the twins never make; a bad
    # --tokenizer is an error before Ray starts); the ingress loads its own from `source`.
    setup = _engine_setup(args, settings, source.load() if args.simulate else None)
    local = args.ray == LOCAL
    if local:  # the workers a new local instance starts import this checkout, as this process
        root = str(Path(__file__).resolve().parents[2])
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [root, *filter(None, [os.environ.get("PYTHONPATH")])])
    connect(args.ray, args.data_parallel)
    stop = threading.Event()
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, lambda *_: stop.set())
    name = args.served_model_name or Path(settings.model).name
    try:
        info = deploy(setup, args.data_parallel, args.routing, name,
                      {"max_waiting": args.max_waiting, "api_key": api_key,
                       "max_body_bytes": args.max_body_bytes, **_log_options(args),
                       **_chat_options(args)},
                      args.host, args.port, source)
        each = f"each {info.device}" if args.simulate else "each"  # a twin: the GPU it plays
        print(f"zipage serve: {name} on Ray ({args.ray}), {args.data_parallel} replicas routed "
              f"{args.routing}, {each} with {info.capacity.num_blocks} KV blocks of "
              f"{info.config.block_size} tokens; listening on http://{args.host}:{args.port}",
              file=sys.stderr, flush=True)
        stop.wait()
    finally:
        if local:
            serve.shutdown()
        else:  # the cluster's own Serve instance may run other applications
            from zipage.serve.ray_serve import ENGINE_APP, INGRESS_APP

            for app in (INGRESS_APP, ENGINE_APP):
                serve.delete(app)
        ray.shutdown()
    return 0


def _tokenizer_source(args: argparse.Namespace, settings) -> TokenizerSource:
    """The HTTP side's tokenizer: the model's own, or under --simulate the twin's (--tokenizer,
    else --model's when it is a path, else none)."""
    return TokenizerSource(settings.model, args.tokenizer, args.simulate)


def _engine_setup(args: argparse.Namespace, settings, tokenizer=None):
    """What each engine process is built from (one, a replica, or a Ray replica); under
    --simulate the twin, on the CPU (a replica on its own slice of the cores)."""
    from zipage.serve.wire import Setup, Simulate

    if args.simulate:
        special = frozenset(getattr(tokenizer, "all_special_ids", None) or ())
        return Setup(settings, "cpu", False, None, None, simulate=Simulate(special))
    return Setup(settings, "cuda" if args.engine == "gpu" else "cpu", not args.no_cuda_graphs,
                 args.prefill_graphs, args.threads)


def _log_options(args: argparse.Namespace) -> dict:
    """`build_app`'s access log and stats line, from --disable-access-log, --disable-log-stats
    and --log-stats-interval."""
    return {"access_log": not args.disable_access_log,
            "log_stats_s": None if args.disable_log_stats else args.log_stats_interval}


def _http_server(args: argparse.Namespace, engine, tokenizer, name: str, api_key: str | None):
    """uvicorn over the app, with the timeouts and the drain deadline (zipage/serve/listen.py)."""
    import uvicorn

    from zipage.serve.app import build_app
    from zipage.serve.listen import DRAIN_GRACE_S, DrainingServer, guarded_protocol

    app = build_app(engine, tokenizer, name, max_waiting=args.max_waiting,
                    api_key=api_key, max_body_bytes=args.max_body_bytes,
                    **_log_options(args), **_chat_options(args))
    # uvicorn's own access log stays off: ours (zipage/serve/logs.py) has the id and tokens.
    config = uvicorn.Config(app, log_level="warning", access_log=False,
                            http=guarded_protocol(args.header_timeout, args.body_timeout,
                                                  args.max_connections),
                            timeout_keep_alive=args.keep_alive_timeout,
                            timeout_graceful_shutdown=args.drain_timeout + DRAIN_GRACE_S)
    server = DrainingServer(config, args.drain_timeout, lambda: engine.close(
        f"the server is shutting down and the request was still running after "
        f"--drain-timeout {args.drain_timeout:g} s"))
    engine.on_fatal = lambda: setattr(server, "should_exit", True)
    return server


def _serve_status(server, engine) -> int:
    """0 once stopped and drained; 1 when the engine could not be kept up."""
    if engine.fatal is not None:
        return 1
    if server.deadline_passed:
        print("zipage serve: stopped; requests still running at the drain deadline were "
              "failed", file=sys.stderr, flush=True)
    return 0
