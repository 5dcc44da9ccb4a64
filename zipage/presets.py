"""Models we know by name: the one table of public architecture shapes.

Both twins read it: the simulator and the memory planner need only the shapes; the engine builds
random weights from the same entries (`random:qwen3-8b`) for throughput work where the weights do
not matter. Numbers are the public `config.json` values of each model.
"""

from __future__ import annotations

import json
from pathlib import Path

from zipage.errors import UnknownModelError
from zipage.shape import ModelShape  # noqa: F401  (re-exported: the shape type)


def _qwen3(name, layers, hidden, heads, intermediate, tie) -> ModelShape:
    return ModelShape(
        name=name, architecture="qwen3", num_layers=layers, hidden_size=hidden, num_heads=heads,
        num_kv_heads=8, head_dim=128, intermediate_size=intermediate, vocab_size=151936,
        tie_embeddings=tie, rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position=40960,
        qk_norm=True,
    )


_LLAMA3_SCALING = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _llama31_8b(name: str) -> ModelShape:
    return ModelShape(
        name=name, architecture="llama", num_layers=32, hidden_size=4096, num_heads=32,
        num_kv_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
        tie_embeddings=False, rope_theta=500_000.0, rms_norm_eps=1e-5, max_position=131072,
        rope_scaling=dict(_LLAMA3_SCALING),
    )


PRESETS: dict[str, ModelShape] = {
    shape.name: shape
    for shape in [
        _qwen3("qwen3-0.6b", 28, 1024, 16, 3072, tie=True),
        _qwen3("qwen3-1.7b", 28, 2048, 16, 6144, tie=True),
        _qwen3("qwen3-4b", 36, 2560, 32, 9728, tie=True),
        _qwen3("qwen3-8b", 36, 4096, 32, 12288, tie=False),
        _qwen3("qwen3-14b", 40, 5120, 40, 17408, tie=False),
        _qwen3("qwen3-32b", 64, 5120, 64, 25600, tie=False),
        _llama31_8b("llama-3.1-8b"),
        _llama31_8b("deepseek-r1-distill-llama-8b"),
        ModelShape(
            name="qwen2.5-0.5b", architecture="qwen2", num_layers=24, hidden_size=896,
            num_heads=14, num_kv_heads=2, head_dim=64, intermediate_size=4864,
            vocab_size=151936, tie_embeddings=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
            max_position=32768, qkv_bias=True,
        ),
        ModelShape(
            name="qwen2.5-7b", architecture="qwen2", num_layers=28, hidden_size=3584,
            num_heads=28, num_kv_heads=4, head_dim=128, intermediate_size=18944,
            vocab_size=152064, tie_embeddings=False, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
            max_position=32768, qkv_bias=True,
        ),
        ModelShape(
            name="smollm2-135m", architecture="llama", num_layers=30, hidden_size=576,
            num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
            tie_embeddings=True, rope_theta=100_000.0, rms_norm_eps=1e-5, max_position=8192,
        ),
    ]
}

# Names people type: "Qwen3-8B", "qwen3_8b", "meta-llama/Llama-3.1-8B" all find the preset.
_ALIASES = {
    "ds-llama-8b": "deepseek-r1-distill-llama-8b",
    "llama-8b": "llama-3.1-8b",
    "smollm2-135m-instruct": "smollm2-135m",
}


def _normalise(name: str) -> str:
    key = name.strip().lower().replace("_", "-")
    key = key.split("/")[-1]
    if key.startswith("random:"):
        key = key[len("random:"):]
    return _ALIASES.get(key, key)


def get_preset(name: str) -> ModelShape:
    """Look a model up by (case-insensitive) preset name, with or without a `random:` prefix."""
    key = _normalise(name)
    if key not in PRESETS:
        known = ", ".join(sorted(PRESETS))
        raise UnknownModelError(
            f"model: unknown preset {name!r}; known presets are {known} "
            "(or pass a HF model directory or a .gguf file)"
        )
    return PRESETS[key]


# ---------------------------------------------------------------- shapes of models on disk

ARCHITECTURES = ("llama", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def shape_from_hf_config(config: dict, name: str) -> ModelShape:
    """The `ModelShape` of a HF config (`PretrainedConfig.to_dict()`, or a config.json of the same form).

    Features our implementations lack are refused here, naming the config field, rather than
    silently computing something else; so is a field of the wrong type or out of range (a
    config.json is user input: it must fail with one line, not deep inside the engine).
    """
    if not isinstance(config, dict):
        raise UnknownModelError(f"model: {name}: config.json must hold a JSON object, "
                                f"got {type(config).__name__}")
    fields = _ConfigFields(config, name, "config.json")
    architecture = config.get("model_type")
    if architecture not in ARCHITECTURES:
        raise UnknownModelError(
            f"model: {name}: model_type {architecture!r} is not supported; "
            f"supported model types are {', '.join(ARCHITECTURES)}"
        )
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


def shape_from_gguf(path: Path, reader=None) -> ModelShape:
    """Read a GGUF file's architecture metadata (no weights, no torch) into a `ModelShape`.
    `reader`: an already open `GGUFReader` of the file (the engine parses the file once)."""
    reader = reader if reader is not None else open_gguf(path)
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


def model_label(spec: str) -> str:
    """What a model is called wherever it was named: the last part of a path (a HF directory's
    name, a .gguf file's stem: the name its shape carries), without `random:`. So a profile
    written from `--model path/THE.gguf` and a run of `--model THE.gguf` name the same model."""
    name = spec.strip().replace("\\", "/").rstrip("/").split("/")[-1]
    name = name.removeprefix("random:").removeprefix("RANDOM:")
    return name[:-len(".gguf")] if name.lower().endswith(".gguf") else name


def model_identity(spec: str) -> str:
    """`model_label`, folded for comparison (case, `_` against `-`): two names of one model give
    the same identity."""
    return model_label(spec).lower().replace("_", "-")


def resolve_shape(spec: str) -> ModelShape:
    """The shape behind any `--model` value: a preset (optionally `random:`), a HF model
    directory, or a .gguf file. The simulator needs nothing else of a model."""
    path = Path(spec).expanduser()
    if path.is_dir():
        config_path = path / "config.json"
        if not config_path.is_file():
            raise UnknownModelError(f"model: {spec} is a directory without config.json; pass a "
                                    "HF model directory, a .gguf file or a preset name")
        return shape_from_hf_config(read_config_json(path), path.name)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UnknownModelError(f"model: GGUF file {spec} does not exist")
        return shape_from_gguf(path)
    return get_preset(spec)
