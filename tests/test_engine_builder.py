"""The engine builder (zipage/engine/builder.py): its capacity check, and its order (the capacity
is refused before the weights are read)."""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")

from zipage.config import ZipageConfig  # noqa: E402
from zipage.core.deployment import ReplaySettings  # noqa: E402
from zipage.core.memory import GIB, MemoryPlan  # noqa: E402
from zipage.engine.builder import build_engine, check_capacity  # noqa: E402
from zipage.errors import ConfigError, MemoryPlanError  # noqa: E402

CONFIG = ZipageConfig(block_size=16, window=4, kv_budget=32)  # N_max = 3
TINY_LLAMA = {
    "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256,
    "max_position_embeddings": 512,
}


def test_check_capacity_names_what_does_not_fit(monkeypatch):
    short = MemoryPlan(num_blocks=5, num_query_slots=2, block_bytes=GIB, query_slot_bytes=0,
                       available_bytes=5 * GIB)
    with pytest.raises(ConfigError, match="5 blocks cannot back 2 query slots of N_max = 3"):
        check_capacity(CONFIG, short, torch.device("cpu"))
    plan = MemoryPlan(num_blocks=6, num_query_slots=2, block_bytes=GIB, query_slot_bytes=0,
                      available_bytes=6 * GIB)
    check_capacity(CONFIG, plan, torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2 * GIB, 80 * GIB))
    with pytest.raises(MemoryPlanError, match="the caches need 6.0 GiB but only 2.0 GiB are "
                                              "free on the GPU.*--gpu-memory-utilization"):
        check_capacity(CONFIG, plan, torch.device("cuda"))


@pytest.mark.engine
def test_a_capacity_that_cannot_be_planned_is_refused_before_the_weights_are_read(tmp_path):
    """The weights file is garbage: reading it would fail. The plan fails first."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    (tmp_path / "model.safetensors").write_bytes(os.urandom(512))
    settings = ReplaySettings(model=str(tmp_path), dtype="float32", kv_memory_gb=1e-6,
                              config=CONFIG)
    with pytest.raises(MemoryPlanError):
        build_engine(settings, "cpu", cuda_graphs=False)
