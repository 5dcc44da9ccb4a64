"""A `--model` value resolved: the one place a preset name, a HF directory or a .gguf file becomes
a `ModelShape`.

Both twins resolve a model here, so the same flags plan the same blocks in the simulator and in
the engine, and the engine builds its model from the shape the simulator planned. It reads only
config.json or the GGUF metadata: no torch, no transformers. Where a config.json leaves a field
out, the shape takes what transformers' config class of that architecture takes
(`_OMITTED_FIELDS`), because the checkpoint's tensors were made by that class.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from zipage.errors import UnknownModelError
from zipage.presets import get_preset
from zipage.shape import ModelShape

ARCHITECTURES = ("llama", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# The files that make a HF model directory's tokenizer (any one of them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

# The value transformers' config class gives a field that config.json omits, where it is not the
# generic reading below (head_dim = hidden_size / num_attention_heads, num_key_value_heads =
# num_attention_heads; the same readings fill an explicit null). LlamaConfig takes the generic
# readings. Qwen2Config has no head_dim (its attention divides, as here). Qwen2Config and
# Qwen3Config default num_key_value_heads to 32, not to the head count. Qwen3Config defaults
# head_dim to 128 whatever the width, as every Qwen3 model has it (Qwen3-0.6B: 1024 / 16 = 64 by
# division). tests/test_model_spec.py checks each against transformers' own model.
_OMITTED_FIELDS = {
    "llama": {},
    "qwen2": {"num_key_value_heads": 32},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128},
}
# The parameters each RoPE type reads (`zipage.engine.layers.rope_inverse_frequencies`).
_ROPE_PARAMETERS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor",),
}


@dataclass(frozen=True)
class ModelSpec:
    """What a `--model` value names: the model's shape, and its files (none for a preset)."""

    spec: str  # as given
    shape: ModelShape
    path: Path | None = None  # the HF directory or .gguf file
    # The open `gguf.GGUFReader` of a .gguf file: the engine reads the weights through it rather
    # than parsing the file a second time (seconds for a 100 MB file).
    gguf: object | None = field(default=None, repr=False, compare=False)


def resolve_model(spec: str) -> ModelSpec:
    """The model behind any `--model` value: a preset (optionally `random:`), a HF model
    directory, or a .gguf file."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return ModelSpec(spec, hf_directory_shape(path), path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UnknownModelError(f"model: GGUF file {spec} does not exist")
        reader = open_gguf(path)
        return ModelSpec(spec, shape_from_gguf(path, reader), path, reader)
    return ModelSpec(spec, get_preset(spec))


def resolve_shape(spec: str) -> ModelShape:
    """The shape behind any `--model` value (`resolve_model`); the simulator needs nothing else."""
    return resolve_model(spec).shape


def hf_directory_shape(directory: Path) -> ModelShape:
    if not (directory / "config.json").is_file():
        raise UnknownModelError(f"model: {directory} is a directory without config.json; pass a "
                                "HF model directory, a .gguf file or a preset name")
    return shape_from_hf_config(read_config_json(directory), directory.name)


def shape_from_hf_config(config: dict, name: str) -> ModelShape:
    """The `ModelShape` of a HF config.json (or a `PretrainedConfig.to_dict()`).

    Features our implementations lack are refused here, naming the config field, rather than
    silently computing something else; so is a field of the wrong type or out of range (a
    config.json is user input: it must fail with one line, not deep inside the engine).
    """
    if not isinstance(config, dict):
        raise UnknownModelError(f"model: {name}: config.json must hold a JSON object, "
                                f"got {type(config).__name__}")
    architecture = config.get("model_type")
    if architecture not in ARCHITECTURES:
        raise UnknownModelError(
            f"model: {name}: model_type {architecture!r} is not supported; "
            f"supported model types are {', '.join(ARCHITECTURES)}"
        )
    fields = _ConfigFields({**_OMITTED_FIELDS[architecture], **config}, name, "config.json")
    unsupported = {
        "hidden_act": config.get("hidden_act", "silu") != "silu",
        "attention_bias": architecture != "qwen2" and bool(config.get("attention_bias")),
        "mlp_bias": bool(config.get("mlp_bias")),
        "use_sliding_window": bool(config.get("use_sliding_window")),
    }
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise UnknownModelError(f"model: {name}: config.json field rope_scaling must be an "
                                f"object, got {rope!r}")
    rope = dict(rope)
    rope_theta = fields.number("rope_theta", rope.pop("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    unsupported["rope_parameters.rope_type"] = rope_type not in ROPE_TYPES
    unsupported["rope_parameters.partial_rotary_factor"] = (
        rope.pop("partial_rotary_factor", 1.0) != 1.0)
    refused = [field_name for field_name, is_refused in unsupported.items() if is_refused]
    if refused:
        raise UnknownModelError(
            f"model: {name}: unsupported config value(s) for {', '.join(refused)} (we implement "
            f"SiLU MLPs without biases, full attention, RoPE types {', '.join(ROPE_TYPES)})"
        )
    for parameter in _ROPE_PARAMETERS[rope_type]:
        fields.number(f"rope_parameters.{parameter}", rope.get(parameter))
    num_heads = fields.count("num_attention_heads")
    hidden_size = fields.count("hidden_size")
    shape = ModelShape(
        name=name,
        architecture=architecture,
        num_layers=fields.count("num_hidden_layers"),
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=fields.count("num_key_value_heads", num_heads),
        head_dim=fields.count("head_dim", hidden_size // num_heads),
        intermediate_size=fields.count("intermediate_size"),
        vocab_size=fields.count("vocab_size"),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope_theta=rope_theta,
        rms_norm_eps=fields.number("rms_norm_eps", config.get("rms_norm_eps", 1e-6)),
        max_position=fields.count("max_position_embeddings"),
        rope_scaling={} if rope_type == "default" else {"rope_type": rope_type, **rope},
        qkv_bias=architecture == "qwen2",
        qk_norm=architecture == "qwen3",
    )
    return check_shape(shape, f"{name}: config.json")


class _ConfigFields:
    """Typed reads of a model config: a missing field, a string where a count belongs or a
    zero head count becomes one line naming the field, not a TypeError in the planner."""

    _REQUIRED = object()

    def __init__(self, values: dict, name: str, source: str) -> None:
        self.values, self.name, self.source = values, name, source

    def count(self, key: str, default=_REQUIRED) -> int:
        value = self.values.get(key)
        if value is None:  # HF writes null for "use the default"
            if default is self._REQUIRED:
                raise UnknownModelError(f"model: {self.name}: {self.source} lacks {key}")
            value = default
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UnknownModelError(f"model: {self.name}: {self.source} field {key} must be a "
                                    f"positive integer, got {value!r}")
        return value

    def number(self, key: str, value) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                or value == float("inf"):
            raise UnknownModelError(f"model: {self.name}: {self.source} field {key} must be a "
                                    f"positive number, got {value!r}")
        return float(value)


def check_shape(shape: ModelShape, source: str) -> ModelShape:
    """Refuse head counts no attention layer can be built from."""
    if shape.num_heads % shape.num_kv_heads:
        raise UnknownModelError(f"model: {source}: {shape.num_heads} attention heads cannot be "
                                f"shared by {shape.num_kv_heads} key/value heads (not a divisor)")
    return shape


def read_config_json(directory: Path) -> dict:
    """A model directory's config.json as a dict; a clear error when it is not JSON."""
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UnknownModelError(f"model: {path} is not valid JSON ({error}); "
                                "pass a HF model directory's config.json") from None
    if not isinstance(config, dict):
        raise UnknownModelError(f"model: {path} must hold a JSON object, "
                                f"got {type(config).__name__}")
    return config


def open_gguf(path: Path):
    """A `gguf.GGUFReader` over `path`; one line naming the file when it is not a GGUF file."""
    try:
        from gguf import GGUFReader
    except ImportError as error:
        raise UnknownModelError(
            f"model: reading {path} needs the gguf package: pip install 'zipage[gguf]'") from error
    try:
        return GGUFReader(str(path))
    except Exception as error:  # noqa: BLE001 - any failure to parse a user's file is about the file
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UnknownModelError(f"model: {path} is not a readable GGUF file ({reason})") from None


def shape_from_gguf(path: Path, reader) -> ModelShape:
    """A GGUF file's architecture metadata (no weights, no torch) as a `ModelShape`; `reader`:
    the file's open `GGUFReader`."""
    source = f"{path.name} (GGUF metadata)"

    def value(key: str, default=None):
        field_ = reader.fields.get(key)
        if field_ is None:
            if default is None:
                raise UnknownModelError(f"model: {path}: GGUF metadata lacks {key}")
            return default
        try:
            return field_.contents()
        except Exception as error:  # noqa: BLE001 - a corrupt field of a user's file
            raise UnknownModelError(f"model: {path}: GGUF metadata field {key} is unreadable "
                                    f"({error})") from None

    architecture = value("general.architecture")
    if architecture not in ARCHITECTURES:
        raise UnknownModelError(f"model: {path}: GGUF architecture {architecture!r} is not "
                                f"supported; supported: {', '.join(ARCHITECTURES)}")
    tokens = value("tokenizer.ggml.tokens")
    raw = {
        "num_attention_heads": value(f"{architecture}.attention.head_count"),
        "hidden_size": value(f"{architecture}.embedding_length"),
        "num_hidden_layers": value(f"{architecture}.block_count"),
        "intermediate_size": value(f"{architecture}.feed_forward_length"),
        "max_position_embeddings": value(f"{architecture}.context_length"),
        "vocab_size": len(tokens) if isinstance(tokens, list) else tokens,
    }
    fields = _ConfigFields(raw, path.stem, source)
    heads, hidden = fields.count("num_attention_heads"), fields.count("hidden_size")
    fields.values["num_key_value_heads"] = value(f"{architecture}.attention.head_count_kv", heads)
    # llama.cpp reads a file without key_length as heads of embedding_length / head_count wide
    # (its converter writes key_length whenever the HF config has a head_dim): so do we.
    fields.values["head_dim"] = value(f"{architecture}.attention.key_length", hidden // heads)
    has_output = any(tensor.name == "output.weight" for tensor in reader.tensors)
    shape = ModelShape(
        name=path.stem, architecture=architecture,
        num_layers=fields.count("num_hidden_layers"), hidden_size=hidden,
        num_heads=heads, num_kv_heads=fields.count("num_key_value_heads"),
        head_dim=fields.count("head_dim"),
        intermediate_size=fields.count("intermediate_size"),
        vocab_size=fields.count("vocab_size"), tie_embeddings=not has_output,
        rope_theta=fields.number("rope.freq_base",
                                 value(f"{architecture}.rope.freq_base", 10000.0)),
        rms_norm_eps=fields.number("attention.layer_norm_rms_epsilon", value(
            f"{architecture}.attention.layer_norm_rms_epsilon", 1e-6)),
        max_position=fields.count("max_position_embeddings"),
        qkv_bias=architecture == "qwen2", qk_norm=architecture == "qwen3",
    )
    return check_shape(shape, source)
