"""Turns a model spec into one of our models with its weights: a HF directory, a GGUF file, or random weights.

The model's shape is the one `zipage.model_spec` reads (the simulator's), so the model the engine
builds is the model both twins planned for.

- A HF model directory (`config.json` plus `*.safetensors`, sharded or not): each checkpoint
  tensor is copied into our parameters; the separate q/k/v and gate/up projections land in their
  rows of our fused ones.
- A `.gguf` file: parsed once (`gguf_file`); its tensors are dequantised, renamed to HF names and
  copied in exactly like a checkpoint's; transformers builds the tokenizer from its tokenizer keys.
- `random:<preset>` (e.g. `random:qwen3-8b`, from `zipage.presets`, the table the simulator uses too):
  parameters filled with seeded random values directly on the target device, for throughput work
  where the weights do not matter.

Parameters are allocated once, uninitialised, in the requested dtype on the requested device; nothing
is built on the CPU and moved.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from zipage.engine.layers import FusedLinear, RMSNorm
from zipage.engine.models import MODEL_CLASSES
from zipage.engine.models.llama import LlamaForCausalLM
from zipage.errors import UnknownModelError
from zipage.model_spec import TOKENIZER_FILES, ModelSpec, resolve_model
from zipage.presets import PRESETS, get_preset
from zipage.shape import ModelShape

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

RANDOM_PREFIX = "random:"
RANDOM_SEED = 0
RANDOM_STD = 0.02  # the initializer_range of HF configs: keeps activations of a random model finite

# Checkpoint projection name -> (our fused module, its shard).
_FUSED_PROJECTIONS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


def load_model(
    spec: str | ModelSpec, dtype: torch.dtype = torch.bfloat16, device: str | torch.device | None = None
) -> tuple[LlamaForCausalLM, ModelShape, PreTrainedTokenizerBase | None]:
    """Build the model named by `spec` on `device` (default: CUDA if present, else CPU) in `dtype`.

    `spec`: a `--model` value, or the `ModelSpec` `loadable_model` made of one (its GGUF file is
    not parsed again). Returns the model (inference only: no gradients), its shape, and its
    tokenizer (a transformers tokenizer), or None for random weights and for directories that
    ship no tokenizer files.
    """
    check_loadable(spec if isinstance(spec, str) else spec.spec)
    model = resolve_model(spec) if isinstance(spec, str) else spec
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if model.path is None:
        built = build_model(model.shape, dtype, device)
        initialise_random(built, RANDOM_SEED)
        return built, model.shape, None
    if model.gguf is not None:
        return _load_gguf(model, dtype, device)
    return _load_hf_directory(model, dtype, device)


def loadable_model(spec: str) -> ModelSpec:
    """`spec` resolved as the simulator resolves it (`zipage.model_spec`), refused first, with
    the fix, when the engine cannot get weights for it."""
    check_loadable(spec)
    return resolve_model(spec)


def check_loadable(spec: str) -> None:
    """Refuse a spec that names no weights: a preset without `random:`, a path that does not
    exist or holds no model."""
    if spec.lower().startswith(RANDOM_PREFIX):
        return
    path = Path(spec).expanduser()
    if not _is_gguf(path) and not _is_hf_directory(path):
        raise UnknownModelError(_unresolved_message(spec, path))


def _is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def _is_hf_directory(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def load_tokenizer(spec: str) -> PreTrainedTokenizerBase | None:
    """The tokenizer `load_model(spec)` returns, without the weights (`zipage serve` detokenizes
    in its HTTP process while the engine process holds the model). Call it after `load_model`
    accepted `spec`: a path it refuses is refused here with the same message."""
    if spec.lower().startswith(RANDOM_PREFIX):
        return None
    check_loadable(spec)
    path = Path(spec).expanduser()
    if _is_gguf(path):
        from zipage.engine.gguf_file import gguf_tokenizer

        return gguf_tokenizer(path)
    return _hf_tokenizer(path)


def build_model(shape: ModelShape, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """Our model for `shape`, parameters allocated but not initialised, on `device` in `dtype`."""
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = MODEL_CLASSES[shape.architecture](shape)
    finally:
        torch.set_default_dtype(previous_dtype)
    return model.requires_grad_(False).eval()


@torch.no_grad()
def initialise_random(model: LlamaForCausalLM, seed: int) -> None:
    """Seeded random weights, generated on the model's device: N(0, 0.02) matrices, unit norms, zero biases."""
    device = model.model.embed_tokens.weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    for module in model.modules():
        for name, parameter in module.named_parameters(recurse=False):
            fill_random(module, name, parameter, generator)


def fill_random(module: torch.nn.Module, name: str, tensor: torch.Tensor,
                generator: torch.Generator) -> None:
    """The random-weights rule for one parameter (in order, from one generator): unit norms,
    zero biases, N(0, RANDOM_STD) matrices."""
    if isinstance(module, RMSNorm):
        tensor.fill_(1.0)
    elif name == "bias":
        tensor.zero_()
    else:
        tensor.normal_(0.0, RANDOM_STD, generator=generator)


@torch.no_grad()
def load_weights(model: LlamaForCausalLM, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors (HF names) into the model, converting dtype and device. Every parameter
    must be covered, and every tensor must find a parameter (or fused shard) of the same shape."""
    parameters = dict(model.named_parameters())
    fused_modules = {name: module for name, module in model.named_modules() if isinstance(module, FusedLinear)}
    missing = set(_expected_checkpoint_names(parameters, fused_modules))
    for name, tensor in tensors:
        if name.endswith("rotary_emb.inv_freq") or (model.lm_head is None and name == "lm_head.weight"):
            continue  # recomputed by us / the tied head is the embedding itself
        module_path, _, parameter_name = name.rpartition(".")
        owner_path, _, projection = module_path.rpartition(".")
        target = None
        if projection in _FUSED_PROJECTIONS:
            fused_name, shard = _FUSED_PROJECTIONS[projection]
            fused_module = fused_modules.get(f"{owner_path}.{fused_name}")
            if fused_module is not None:
                target = fused_module.shard_view(parameter_name, shard)
        elif name in parameters:
            target = parameters[name].data
        if target is None:
            raise UnknownModelError(
                f"model: checkpoint tensor {name!r} has no place in our {model.shape.architecture} model"
            )
        if target.shape != tensor.shape:
            raise UnknownModelError(
                f"model: checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the config implies "
                f"{tuple(target.shape)}: config.json and the weights disagree"
            )
        target.copy_(tensor)
        missing.discard(name)
    if missing:
        raise UnknownModelError(f"model: the checkpoint lacks {len(missing)} tensor(s), e.g. {sorted(missing)[:3]}")


def _expected_checkpoint_names(
    parameters: dict[str, torch.nn.Parameter], fused_modules: dict[str, FusedLinear]
) -> Iterator[str]:
    """The HF names of every tensor a checkpoint must provide for our parameters."""
    for name in parameters:
        module_path, _, parameter_name = name.rpartition(".")
        if module_path not in fused_modules:
            yield name
            continue
        owner_path, _, fused_name = module_path.rpartition(".")
        for projection, (fused, _) in _FUSED_PROJECTIONS.items():
            if fused == fused_name:
                yield f"{owner_path}.{projection}.{parameter_name}"


def _load_hf_directory(
    model: ModelSpec, dtype: torch.dtype, device: torch.device
) -> tuple[LlamaForCausalLM, ModelShape, PreTrainedTokenizerBase | None]:
    from safetensors import safe_open

    files = _safetensors_files(model.path)
    built = build_model(model.shape, dtype, device)

    def checkpoint_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            with _user_file(file, "a safetensors checkpoint"):
                with safe_open(file, framework="pt", device="cpu") as reader:
                    for name in reader.keys():
                        yield name, reader.get_tensor(name)

    load_weights(built, checkpoint_tensors())
    return built, model.shape, _hf_tokenizer(model.path)


def _hf_tokenizer(directory: Path) -> PreTrainedTokenizerBase | None:
    """A model directory's tokenizer; None if it ships no tokenizer files."""
    from transformers import AutoTokenizer

    if not any((directory / file).is_file() for file in TOKENIZER_FILES):
        return None
    with _user_file(directory, "a tokenizer transformers can load"):
        return AutoTokenizer.from_pretrained(directory)


@contextmanager
def _user_file(path: Path, what: str) -> Iterator[None]:
    """Turn a third-party reader's failure on a user's file into one line naming the file (any
    exception: the file is the input, so whatever breaks the reader is about the file)."""
    try:
        yield
    except UnknownModelError:
        raise
    except Exception as error:  # noqa: BLE001
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UnknownModelError(f"model: {path} is not {what} ({reason})") from None


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        with _user_file(index, "a safetensors index (JSON with a weight_map object)"):
            weight_map = json.loads(index.read_text())["weight_map"]
            return [directory / file for file in sorted(set(weight_map.values()))]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise UnknownModelError(
            f"model: {directory} has no *.safetensors weights (only safetensors checkpoints are read; "
            "re-save the model with save_pretrained(..., safe_serialization=True))"
        )
    return files


def _load_gguf(
    model: ModelSpec, dtype: torch.dtype, device: torch.device
) -> tuple[LlamaForCausalLM, ModelShape, PreTrainedTokenizerBase]:
    """The reader that gave the shape gives the weights (`gguf_file`); the tokenizer reads only
    its own keys."""
    from zipage.engine.gguf_file import gguf_tensors, gguf_tokenizer

    built = build_model(model.shape, dtype, device)
    load_weights(built, gguf_tensors(model.gguf, model.shape, model.path))
    return built, model.shape, gguf_tokenizer(model.path)


def _unresolved_message(spec: str, path: Path) -> str:
    accepted = "a HF model directory (config.json + *.safetensors), a .gguf file, or random:<preset>"
    if path.exists():
        return f"model: {spec!r} is not {accepted}"
    hints = [f"pass {accepted}"]
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        hints.append(f"Hub ids are not downloaded: fetch it first (huggingface-cli download {spec} --local-dir DIR)")
    try:
        get_preset(spec)
        hints.append(f"for random weights of that shape pass 'random:{spec}'")
    except UnknownModelError:
        hints.append(f"presets: {', '.join(sorted(PRESETS))}")
    return f"model: no such path {spec!r}; " + "; ".join(hints)
