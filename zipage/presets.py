"""Models we know by name: the one table of public architecture shapes.

Both twins read it: the simulator and the memory planner need only the shapes; the engine builds
random weights from the same entries (`random:qwen3-8b`) for throughput work where the weights do
not matter. Numbers are the public `config.json` values of each model. `zipage.model_spec` turns
any `--model` value (a preset, a HF directory, a .gguf file) into a shape.
"""

from __future__ import annotations

from zipage.errors import UnknownModelError
from zipage.shape import ModelShape


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
