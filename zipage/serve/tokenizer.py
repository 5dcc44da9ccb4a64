"""The HTTP side's tokenizer (`zipage serve`): where it comes from, loaded where it is used.

The engine's is its model's own (`zipage.engine.loader.load_tokenizer`, torch); the twin's
(`--simulate`) is `--tokenizer`'s, else `--model`'s when that is a path, else none (a preset:
prompts are token ids), and needs no torch for a HF directory. `TokenizerSource` names one of
them, so the HTTP process loads it itself and a Ray ingress replica (`ray_serve.ZipageIngress`,
on another machine perhaps) loads the same one by the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from zipage.errors import UnknownModelError, ZipageError
from zipage.model_spec import TOKENIZER_FILES


@dataclass(frozen=True)
class TokenizerSource:
    """`--model` (and, under --simulate, `--tokenizer`): what `load` reads."""

    model: str
    tokenizer: str | None = None  # --simulate's --tokenizer
    simulate: bool = False

    def load(self):
        """The tokenizer, or None where prompts are token ids (random weights, a bare preset)."""
        if self.simulate:
            return twin_tokenizer(self.tokenizer, self.model)
        from zipage.engine.loader import load_tokenizer

        return load_tokenizer(self.model)


def twin_tokenizer(tokenizer: str | None, model: str):
    """--simulate's tokenizer: --tokenizer's, else --model's when it is a path; None for a preset
    (prompts are then token ids). An HF directory's needs transformers alone; a .gguf file's
    needs torch too (transformers reads GGUF files with it)."""
    flag, spec = ("--tokenizer", tokenizer) if tokenizer is not None else ("--model", model)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        try:
            from zipage.engine.loader import load_tokenizer
        except ImportError:
            raise ZipageError(f"{flag}: {spec}: a .gguf file's tokenizer needs torch (transformers "
                              "reads GGUF with it); pip install torch, or pass the model's HF "
                              "directory as --tokenizer") from None
        return load_tokenizer(str(path))
    if not path.is_dir():
        if tokenizer is not None:
            raise UnknownModelError(f"--tokenizer: {spec} is neither a HF model directory nor "
                                    "a .gguf file")
        return None  # a preset: its shape alone (a path that is neither fails as --model)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        if tokenizer is None:
            return None  # a model directory without one: token ids, as on the engine
        raise UnknownModelError(f"--tokenizer: {spec} has none of {', '.join(TOKENIZER_FILES)}")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as error:  # noqa: BLE001 - the directory is the user's input
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UnknownModelError(f"{flag}: {spec} holds no tokenizer transformers can load "
                                f"({reason})") from None
