"""bench/peer_tables.py takes a run apart from its step records: the decode roofline is priced at the
run's own KV bytes a token (fp8's entries and scales, not bf16's), as the memory planner counts them."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from peer_tables import breakdown  # noqa: E402

from zipage.core.memory import kv_entry_bytes, kv_token_bytes, weight_bytes  # noqa: E402
from zipage.presets import get_preset  # noqa: E402

MODEL = "llama-3.1-8b"
BANDWIDTH = 4e12


def decode_step(start: float, context_tokens: int, batch: int = 200) -> SimpleNamespace:
    return SimpleNamespace(t_start=start, t_end=start + 0.05, prefill_tokens=0, n_decode=batch,
                           decode_context_tokens=context_tokens, n_compress=0, batches_done=0)


def test_kv_bytes_a_token_follow_the_cache_dtype():
    shape = get_preset(MODEL)
    for dtype in ("auto", "fp8"):
        assert kv_token_bytes(shape, dtype, 2) == 2 * shape.num_layers * shape.num_kv_heads * kv_entry_bytes(
            shape.head_dim, dtype, 2)
    assert kv_token_bytes(shape, "fp8", 2) < kv_token_bytes(shape, "auto", 2)


def test_an_fp8_runs_roofline_counts_fp8_bytes():
    run = SimpleNamespace(steps=[decode_step(0.1 * index, 400_000 + 1_000 * index) for index in range(5)])
    weights = weight_bytes(get_preset(MODEL), 2)
    for dtype in ("auto", "fp8"):
        parts = breakdown(run, MODEL, BANDWIDTH, dtype)
        median_context = 402_000
        want_ms = 1000 * (weights + median_context * kv_token_bytes(get_preset(MODEL), dtype, 2)) / BANDWIDTH
        assert parts["decode_roofline_ms_batch_ge_128"] == pytest.approx(want_ms, rel=1e-9)
        assert parts["decode_steps"] == 5
    assert (breakdown(run, MODEL, BANDWIDTH, "fp8")["decode_roofline_ms_batch_ge_128"]
            < breakdown(run, MODEL, BANDWIDTH)["decode_roofline_ms_batch_ge_128"])
