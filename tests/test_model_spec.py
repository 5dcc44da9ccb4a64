"""One model-spec resolver for both twins (zipage/model_spec.py).

A HF directory whose config.json has no head_dim is the case that used to split them: the
simulator divided the width by the heads while the engine took transformers' per-architecture
default (Qwen3's 128). Here transformers' own model of each such directory gives the head width,
both twins plan the same blocks from one set of flags, and the engine's model is built, and its
checkpoint loaded, with that width.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings
from zipage.model_spec import ARCHITECTURES, resolve_shape
from zipage.sim.simulate import plan_deployment

TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


def _directory_without_head_dim(tmp_path: Path, architecture: str) -> tuple[Path, int]:
    """A tiny random checkpoint of `architecture` whose config.json lacks head_dim, and the head
    width of the model transformers builds from that config.json."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    directory = tmp_path / architecture
    config = getattr(transformers, CONFIG_CLASSES[architecture])(**TINY)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    raw.pop("head_dim", None)
    path.write_text(json.dumps(raw))
    hf_model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(directory))
    return directory, hf_model.model.layers[0].self_attn.head_dim


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_shape_without_head_dim_has_transformers_head_width(tmp_path, architecture):
    directory, hf_head_dim = _directory_without_head_dim(tmp_path, architecture)
    assert resolve_shape(str(directory)).head_dim == hf_head_dim
    if architecture == "qwen3":
        assert hf_head_dim == 128 != TINY["hidden_size"] // TINY["num_attention_heads"]


@pytest.mark.engine
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_both_twins_plan_the_same_blocks_without_head_dim(tmp_path, architecture):
    pytest.importorskip("torch")
    from zipage.engine.builder import build_engine

    directory, hf_head_dim = _directory_without_head_dim(tmp_path, architecture)
    settings = ReplaySettings(model=str(directory), dtype="float32", kv_memory_gb=0.004,
                              config=ZipageConfig(block_size=16, window=4, kv_budget=32))
    simulated = plan_deployment(settings)
    engine = build_engine(settings, "cpu", cuda_graphs=False)
    assert engine.shape == simulated.shape and engine.config == simulated.config
    assert engine.capacity == simulated.capacity
    # The checkpoint transformers wrote loaded into a model of this width (a wrong width is a
    # shape mismatch in the loader), and the caches hold entries of it.
    assert engine.model.model.layers[0].self_attn.head_dim == hf_head_dim
    assert engine.runner.caches.kv.shape[-1] == hf_head_dim
