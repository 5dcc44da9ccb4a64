"""`zipage generate`: text from the real engine for prompts on the command line or in a file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zipage.cli.flags import DTYPE_HELP, add_knob_flags, add_threads_flag, config_from_args, default_dtype
from zipage.cli.output import EXIT_OK, EXIT_REQUESTS_FAILED
from zipage.dtypes import DTYPE_BYTES
from zipage.errors import ZipageError


def add_parser(commands) -> None:
    generate = commands.add_parser(
        "generate", help="generate text with the real engine",
        description="Generate with the real engine. Defaults differ from the Python API's "
                    "SamplingParams on purpose: greedy decoding (--temperature 0) and 128 tokens, "
                    "so the same command prints the same text (SamplingParams: 1.0 and 256).",
        epilog="examples:\n"
               "  zipage generate --model SmolLM2-135M-Instruct.Q4_1.gguf --chat "
               "\"What is the capital of France?\"\n"
               "  zipage generate --model path/to/model_dir \"The capital of France is\" "
               "\"2 + 2 =\"\n"
               "  cat prompts.txt | zipage generate --model path/to/model.gguf --file -\n"
               "  zipage generate --model random:smollm2-135m ids:1,2,3 --max-tokens 8",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    generate.add_argument("prompts", nargs="*",
                          help="prompt text, or token ids as ids:1,2,3 for random-weight models")
    generate.add_argument("--file", default=None,
                          help="read more prompts from FILE, one per line (- reads stdin)")
    generate.add_argument("--chat", action="store_true",
                          help="wrap each prompt as a user message in the model's chat template "
                               "(instruct models)")
    generate.add_argument("--system", default=None,
                          help="with --chat: a system message before each prompt")
    generate.add_argument("--model", required=True,
                          help="HF model directory, .gguf file or random:<preset>")
    generate.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    generate.add_argument("--dtype", default=None, choices=list(DTYPE_BYTES), help=DTYPE_HELP)
    generate.add_argument("--kv-memory-gb", type=float, default=None,
                          help="memory for KV blocks + query slots (default: 1 on the CPU; "
                               "what the GPU has left on the GPU)")
    generate.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                          help="share of GPU memory Zipage may use (default 0.9)")
    generate.add_argument("--max-tokens", type=int, default=128,
                          help="output tokens at most per prompt (default 128)")
    generate.add_argument("--temperature", type=float, default=0.0,
                          help="0 is greedy (default 0)")
    generate.add_argument("--top-k", type=int, default=0, help="0 keeps every token (default 0)")
    generate.add_argument("--top-p", type=float, default=1.0,
                          help="1.0 keeps every token (default 1.0)")
    generate.add_argument("--seed", type=int, default=None,
                          help="sampling seed (default: unseeded)")
    generate.add_argument("--ignore-eos", action="store_true",
                          help="keep generating past the end-of-sequence token")
    generate.add_argument("--tensor-parallel", type=int, default=1,
                          help="ranks (GPUs, or CPU processes) the model is sharded over "
                               "(default 1)")
    add_threads_flag(generate)
    add_knob_flags(generate)
    generate.set_defaults(handler=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    prompts = _read_prompts(args)
    try:
        from zipage.core.sampling import SamplingParams
        from zipage.engine.builder import resolve_device
        from zipage.engine.llm import LLM
    except ImportError as error:
        raise ZipageError("zipage generate needs the engine: pip install 'zipage[engine]'"
                          ) from error
    config = config_from_args(args)
    dtype = args.dtype or default_dtype(resolve_device(args.device).type)
    llm = LLM(args.model, dtype=dtype,
              device=args.device, kv_memory_gb=args.kv_memory_gb,
              gpu_memory_utilization=args.gpu_memory_utilization, threads=args.threads,
              tensor_parallel=args.tensor_parallel, **config.to_dict())
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            seed=args.seed, max_tokens=args.max_tokens,
                            ignore_eos=args.ignore_eos)
    with llm:
        if args.chat:
            system = [{"role": "system", "content": args.system}] if args.system else []
            if any(isinstance(prompt, list) for prompt in prompts):
                raise ZipageError("--chat: prompts must be text, not ids:...")
            outputs = llm.chat([[*system, {"role": "user", "content": prompt}]
                                for prompt in prompts], params, progress=False)
        else:
            outputs = llm.generate(prompts, params, progress=False)
    empty = []
    for index, (prompt, output) in enumerate(zip(prompts, outputs), start=1):
        if len(prompts) > 1:  # label each answer with its prompt, so they cannot run together
            print(f"{'' if index == 1 else chr(10)}[{index}/{len(prompts)}] {_short(prompt)}")
        if output.error is not None:
            print(f"[failed] {output.error}")
            continue
        text = output.text if output.text is not None else " ".join(map(str, output.token_ids))
        print(text)
        if not text.strip():
            empty.append(index)
    if empty:
        print(f"warning: {_empty_output_line(empty, len(prompts), args.chat)}", file=sys.stderr)
    failed = sum(output.error is not None for output in outputs)
    return EXIT_OK if not failed else EXIT_REQUESTS_FAILED


def _empty_output_line(empty: list[int], prompts: int, chat: bool) -> str:
    """One line for answers with no text: generation worked (exit 0), but an empty line on
    stdout says nothing. Most often an instruct model prompted without its chat template, which
    ends its turn at once."""
    which = ("the output is empty" if prompts == 1 else
             f"the output{'s' * (len(empty) > 1)} of prompt{'s' * (len(empty) > 1)} "
             f"{', '.join(map(str, empty))} of {prompts} {'are' if len(empty) > 1 else 'is'} empty")
    if chat:
        return f"{which}: the model produced no text"
    return (f"{which}: the model produced no text; an instruct model prompted without its chat "
            "template often ends at once: add --chat")


def _read_prompts(args: argparse.Namespace) -> list[str | list[int]]:
    """The positional prompts, then one per non-empty line of --file (`-`: standard input)."""
    prompts = list(args.prompts)
    if args.file is not None:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ZipageError("prompts: give at least one prompt, or --file FILE (one prompt per "
                          "line; - reads standard input)")
    return [_parse_prompt(prompt) for prompt in prompts]


def _short(prompt: str | list[int], width: int = 70) -> str:
    text = prompt if isinstance(prompt, str) else "ids:" + ",".join(map(str, prompt))
    text = text.replace("\n", " ")
    return text if len(text) <= width else text[:width - 3] + "..."


def _parse_prompt(prompt: str) -> str | list[int]:
    """A prompt is text, or token ids written as `ids:1,2,3` (for models without a tokenizer)."""
    if prompt.startswith("ids:"):
        try:
            return [int(token) for token in prompt[4:].split(",") if token]
        except ValueError as error:
            raise ZipageError(f"prompt: {prompt!r} is not a list of token ids like ids:1,2,3"
                              ) from error
    return prompt
