"""The `zipage` command: its parser (one module of this package per subcommand) and `main`.

Every subcommand maps flags onto the same objects the Python API uses (`ZipageConfig`,
`ReplaySettings`). A `ZipageError` — anything a user can cause — prints one line and exits 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

from zipage.cli import bench, calibrate, compare, fidelity, generate, plan, quality, replay, report, serve, trace
from zipage.cli.output import EXIT_USAGE, close_progress_bars
from zipage.errors import ZipageError

# In the order `zipage --help` lists them.
COMMANDS = (replay, calibrate, fidelity, quality, generate, trace, report, compare, plan, serve, bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zipage", description="Compressed PagedAttention inference and its simulator twin",
        epilog="examples:\n"
               "  zipage replay traces/amc23.json                 # simulate Zipage on an A100\n"
               "  zipage replay traces/amc23.json --no-compress   # the Full-KV baseline\n"
               "  zipage replay traces/tiny.json --engine cpu --model random:smollm2-135m\n"
               "  zipage generate --model SmolLM2-135M-Instruct.Q4_1.gguf --chat \"Hi!\"\n"
               "  zipage plan traces/amc23.json --hardware a100,h100 --budget 1024,2048\n"
               "\n"
               "Exit status: 0 done; 1 a `compare --max-error` gate failed; 2 a mistake in the input "
               "(one line on\nstderr); 3 the run finished but some requests failed (results "
               "written). docs/engine.md has more.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    from zipage import __version__

    parser.add_argument("--version", action="version", version=f"zipage {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        print(f"zipage: error: {unknown_arguments(parser, args, unknown)}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return args.handler(args)
    except ZipageError as error:
        close_progress_bars()
        print(f"zipage: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("zipage: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`zipage replay ... | head`): stop quietly, as Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as error:
        # A path the user gave cannot be read or written (missing, a file where a directory
        # belongs, no permission): theirs to fix, so one line. OSErrors without a path are bugs.
        if error.filename is None:
            raise
        close_progress_bars()
        print(f"zipage: error: {error.filename}: {error.strerror or error}", file=sys.stderr)
        return EXIT_USAGE


def unknown_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace,
                      unknown: list[str]) -> str:
    """One line naming the first argument the subcommand does not take and, for a mistyped flag,
    the subcommand's closest flags: argparse would print the top-level usage, which names no
    flag of the subcommand at all."""
    import difflib

    command = _subcommand_parser(parser, args)
    flags = [item for item in unknown if item.startswith("-") and item != "-"]
    first = (flags or unknown)[0]
    others = len(flags) - 1
    more = f" (and {others} more)" if others > 0 else ""
    if first not in flags:
        return (f"{command.prog}: unexpected argument {first!r}{more}; "
                f"`{command.prog} --help` lists what it takes")
    flag = first.split("=", 1)[0]
    options = sorted({option for action in command._actions for option in action.option_strings
                      if action.help != argparse.SUPPRESS})
    close = difflib.get_close_matches(flag, options, n=2, cutoff=0.7)
    hint = (f"did you mean {' or '.join(close)}?" if close
            else f"`{command.prog} --help` lists its flags")
    return f"{command.prog}: unknown flag {flag}{more}; {hint}"


def _subcommand_parser(parser: argparse.ArgumentParser,
                       args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost (sub)command parser the arguments selected: `zipage trace make`'s for
    `zipage trace make ...`."""
    while True:
        subcommands = next((action for action in parser._actions
                            if isinstance(action, argparse._SubParsersAction)), None)
        chosen = getattr(args, subcommands.dest, None) if subcommands is not None else None
        if chosen is None:
            return parser
        parser = subcommands.choices[chosen]


if __name__ == "__main__":
    sys.exit(main())
