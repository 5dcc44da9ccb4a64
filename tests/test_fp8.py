"""FP8 KV cache (`--kv-cache-dtype fp8`, issue #34): quantization round trip, the reference kernels on
an fp8 cache against the same kernels on its dequantized values, the memory plan, and the CPU engine
making the simulator's decisions with an fp8 cache. The Triton kernels against these references run in
tests/test_kernels_attention.py and tests/test_kernels_compress.py (under the interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tiny_models import save_tiny_qwen3  # noqa: E402

from zipage.config import ZipageConfig  # noqa: E402
from zipage.core.deployment import ReplaySettings, plan_capacity  # noqa: E402
from zipage.core.memory import GIB, block_bytes, plan_memory  # noqa: E402
from zipage.errors import ConfigError  # noqa: E402
from zipage.kernels.attention_ref import paged_decode_attention_ref, paged_prefill_attention_ref, store_kv_ref  # noqa: E402
from zipage.kernels.compress import CompressionInputs  # noqa: E402
from zipage.kernels.compress_ref import CompressionParams, compress_ref  # noqa: E402
from zipage.kernels.kv_quant_ref import FP8_DTYPE, FP8_MAX, SCALE_CANDIDATES, dequantize_kv, quantize_kv  # noqa: E402
from zipage.presets import get_preset  # noqa: E402
from zipage.rundir import read_decisions  # noqa: E402
from zipage.trace import Trace, TraceRequest, save_trace  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# e4m3 keeps 3 mantissa bits: rounding to nearest moves a normal value by at most half an ulp,
# 2^-4 of its size; below the smallest normal (2^-6 of the scale's unit) the step is 2^-9 units.
E4M3_RELATIVE = 2.0**-4
E4M3_SUBNORMAL_STEP = 2.0**-9


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# ---------------------------------------------------------------- quantization


def _rows_with_outliers() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    # Rows with outlier channels (as keys have) and rows of tiny values (as values often are).
    x = torch.randn(512, 4, 64, generator=generator) * torch.logspace(-4, 2, 512)[:, None, None]
    x[::7, :, 3] *= 50.0
    return x


def test_round_trip_error_is_within_half_an_e4m3_ulp():
    x = _rows_with_outliers()
    values, scale = quantize_kv(x)
    assert values.dtype == FP8_DTYPE and scale.dtype == torch.float32
    restored = dequantize_kv(values, scale)
    error = (restored - x).abs()
    bound = torch.maximum(E4M3_RELATIVE * x.abs(), 0.5 * E4M3_SUBNORMAL_STEP * scale[..., None])
    # 1e-6 relative slack for the float32 rounding of x / scale and of the product.
    assert torch.all(error <= bound * (1 + 1e-6))
    # Relative to the row's amax: at most 2^-4 of it (half an ulp of the largest value; the scale search trades
    # this worst case, 16 / 448 = 1 / 28 of amax with amax / 448 alone, for a smaller mean square), same slack.
    amax = x.abs().amax(dim=-1)
    assert torch.all(error <= E4M3_RELATIVE * amax[..., None] * (1 + 1e-6))
    # Nothing saturates: the largest value maps to 448 / c <= 448, and comes back within half an ulp.
    assert float(values.float().abs().amax()) <= FP8_MAX
    assert torch.all((restored.abs().amax(dim=-1) - amax).abs() <= E4M3_RELATIVE * amax * (1 + 1e-6))


def test_the_scale_is_the_candidate_of_least_error():
    """Each row's scale is fl(fl(amax / 448) * c) for one c of SCALE_CANDIDATES, and no candidate's round trip
    is better (squared error in float64). Slack: the search measures the error before the float32 product
    value * scale, which moves each element by at most 2^-24 of it, so each row's squared error by at most
    2^-27 of the row's squared norm per candidate; 2^-26 covers both sides."""
    x = _rows_with_outliers()
    _, scale = quantize_kv(x)
    base = x.abs().amax(dim=-1) / FP8_MAX
    errors, is_candidate = [], torch.zeros_like(scale, dtype=torch.bool)
    for candidate in SCALE_CANDIDATES:
        values, candidate_scale = quantize_kv(x, (candidate,))
        torch.testing.assert_close(candidate_scale, base * candidate, rtol=0.0, atol=0.0)
        is_candidate |= torch.isclose(scale, candidate_scale, rtol=0.0, atol=0.0)
        errors.append(((dequantize_kv(values, candidate_scale).double() - x.double()) ** 2).sum(dim=-1))
    assert torch.all(is_candidate)
    chosen = ((dequantize_kv(*quantize_kv(x)).double() - x.double()) ** 2).sum(dim=-1)
    assert torch.all(chosen <= torch.stack(errors).amin(dim=0) + 2.0**-26 * (x.double() ** 2).sum(dim=-1))
    # ... and it pays against amax / 448 alone (the first candidate): measured 11 % less RMS error on these rows.
    assert float(chosen.sum().sqrt()) < 0.95 * float(errors[0].sum().sqrt())


def test_quantization_stays_on_its_input_s_device():
    # The GPU runs the reference too (bench/fp8_gpu.py's checks, the oracle of every fp8 kernel): a
    # helper tensor made on the default device broke it on CUDA. The meta device shows any stray one here.
    values, scales = quantize_kv(torch.empty(4, 2, 64, device="meta"))
    assert (values.device.type, scales.device.type) == ("meta", "meta")
    assert values.dtype == FP8_DTYPE and scales.shape == (4, 2)


def test_a_zero_row_has_scale_one_and_stays_zero():
    values, scale = quantize_kv(torch.zeros(3, 2, 8))
    assert torch.all(scale == 1.0)
    assert torch.all(dequantize_kv(values, scale) == 0.0)


# ---------------------------------------------------------------- reference kernels on an fp8 cache


def _fp8_cache(num_blocks=6, block_size=8, kv_heads=2, head_dim=16):
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return (torch.zeros(shape, dtype=FP8_DTYPE), torch.zeros(shape, dtype=FP8_DTYPE),
            torch.ones(shape[:3]), torch.ones(shape[:3]))


def test_store_kv_quantizes_each_entry_and_head():
    k_cache, v_cache, k_scale, v_scale = _fp8_cache()
    generator = torch.Generator().manual_seed(1)
    key, value = torch.randn(2, 5, 2, 16, generator=generator)
    slots = torch.tensor([3, 9, -1, 40, 17])
    store_kv_ref(key, value, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    kept = slots >= 0
    for source, cache, scales in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        expected_values, expected_scale = quantize_kv(source[kept])
        stored = cache.view(-1, 2, 16)[slots[kept]]
        assert torch.equal(stored.view(torch.uint8), expected_values.view(torch.uint8))
        torch.testing.assert_close(scales.view(-1, 2)[slots[kept]], expected_scale, rtol=0.0, atol=0.0)
    # The skipped token wrote nothing: every other slot still holds zero with scale 1.
    untouched = torch.ones(6 * 8, dtype=torch.bool)
    untouched[slots[kept]] = False
    assert torch.all(k_cache.view(-1, 2, 16)[untouched].float() == 0.0)
    assert torch.all(k_scale.view(-1, 2)[untouched] == 1.0)


@pytest.mark.parametrize("group", [1, 3])
def test_attention_on_fp8_equals_attention_on_its_dequantized_values(group):
    """Paged prefill and decode read fp8 + scales exactly as they read the dequantized cache in float32."""
    k_cache, v_cache, k_scale, v_scale = _fp8_cache()
    generator = torch.Generator().manual_seed(2)
    lengths = [13, 21]
    tables = torch.tensor([[4, 1, -1], [0, 5, 2]], dtype=torch.int32)
    for seq, length in enumerate(lengths):
        slots = torch.tensor([int(tables[seq, i // 8]) * 8 + i % 8 for i in range(length)])
        key, value = torch.randn(2, length, 2, 16, generator=generator)
        store_kv_ref(key, value, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    dense_k, dense_v = dequantize_kv(k_cache, k_scale), dequantize_kv(v_cache, v_scale)
    context = torch.tensor(lengths, dtype=torch.int32)
    q = torch.randn(2, 2 * group, 16, generator=generator)
    fp8 = paged_decode_attention_ref(q, k_cache, v_cache, context, tables, 0.25, k_scale=k_scale, v_scale=v_scale)
    dense = paged_decode_attention_ref(q, dense_k, dense_v, context, tables, 0.25)
    torch.testing.assert_close(fp8, dense, rtol=1e-6, atol=1e-7)
    q = torch.randn(7, 2 * group, 16, generator=generator)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    fp8 = paged_prefill_attention_ref(q, k_cache, v_cache, cu, context, tables, 0.25, k_scale=k_scale,
                                      v_scale=v_scale)
    dense = paged_prefill_attention_ref(q, dense_k, dense_v, cu, context, tables, 0.25)
    torch.testing.assert_close(fp8, dense, rtol=1e-6, atol=1e-7)


def _quantized_batch(seed: int) -> tuple[CompressionInputs, CompressionInputs]:
    """(an fp8 batch with scales, the same batch dequantized to float32): two requests over 2 layers,
    one compressing in place and one into fresh blocks."""
    generator = torch.Generator().manual_seed(seed)
    layers, blocks, block_size, kv_heads, head_dim, window = 2, 10, 16, 2, 16, 4
    shape = (layers, blocks, block_size, kv_heads, head_dim)
    k8, k_scale = quantize_kv(torch.randn(shape, generator=generator) * 3)
    v8, v_scale = quantize_kv(torch.randn(shape, generator=generator))
    common = dict(
        score_cache=0.03 * torch.rand(shape[:4], generator=generator),
        query_cache=torch.randn(layers, 2, window, kv_heads * 2, head_dim, generator=generator),
        source_tables=torch.tensor([[3, 7, 1, 8], [0, 5, 9, -1]], dtype=torch.int32),
        num_source_blocks=torch.tensor([4, 3], dtype=torch.int32),
        target_tables=torch.tensor([[3, 7], [2, 4]], dtype=torch.int32),
        query_slots=torch.tensor([1, 0]), is_compressed=torch.tensor([True, False]))
    fp8 = CompressionInputs(k_cache=k8, v_cache=v8, k_scale=k_scale, v_scale=v_scale, **common)
    dense = CompressionInputs(k_cache=dequantize_kv(k8, k_scale), v_cache=dequantize_kv(v8, v_scale), **common)
    return fp8.clone(), dense.clone()  # separate score caches: both are written


@pytest.mark.parametrize("redundancy", ["lightning", "flash"])
def test_compression_of_fp8_keys_equals_compression_of_their_dequantized_values(redundancy):
    """The scores read the dequantized keys; the compaction moves the fp8 bytes with their scales."""
    fp8, dense = _quantized_batch(seed=3)
    params = CompressionParams(block_size=16, window=4, redundancy=redundancy)
    assert fp8.keywords()["k_scale"] is fp8.k_scale
    compress_ref(*fp8.arguments(params, 0.25), **fp8.keywords())
    compress_ref(*dense.arguments(params, 0.25), **dense.keywords())
    for cache, scale, expected in ((fp8.k_cache, fp8.k_scale, dense.k_cache),
                                   (fp8.v_cache, fp8.v_scale, dense.v_cache)):
        torch.testing.assert_close(dequantize_kv(cache, scale), expected, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(fp8.score_cache, dense.score_cache, rtol=1e-6, atol=1e-9)


# ---------------------------------------------------------------- knob and memory plan


def test_the_knob_takes_auto_or_fp8():
    assert ZipageConfig().kv_cache_dtype == "auto"
    assert "kv_cache_dtype" in ZipageConfig().cost_knobs()
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        ZipageConfig(kv_cache_dtype="int8")


def test_fp8_block_bytes_count_one_byte_values_plus_scales():
    shape = get_preset("qwen3-8b")  # 36 layers, 8 KV heads, head_dim 128
    fp8 = ZipageConfig(kv_cache_dtype="fp8")
    per_token = 2 * 36 * 8 * (128 * 1 + 4) + 36 * 8 * 2  # K+V bytes and scales, + the bf16 global score
    assert block_bytes(shape, fp8, 2) == per_token * 256
    # Full KV: no score; Full KV bf16 holds 2 * 128 * 2 bytes per (layer, head, token).
    assert block_bytes(shape, ZipageConfig(compress=False, kv_cache_dtype="fp8"), 2) == 2 * 36 * 8 * 132 * 256


@pytest.mark.parametrize("compress", [True, False])
def test_fp8_plans_about_twice_the_blocks_of_bf16(compress):
    shape = get_preset("qwen3-8b")
    available = 6 * GIB
    bf16 = plan_memory(shape, ZipageConfig(compress=compress), available, 2)
    fp8 = plan_memory(shape, ZipageConfig(compress=compress, kv_cache_dtype="fp8"), available, 2)
    # 132 against 256 bytes per K or V entry and head (+ the bf16 score and query slots with compression:
    # 1.84x at block 64, budget 512; nearer 1.94x at the defaults).
    assert 1.9 <= fp8.num_blocks / bf16.num_blocks <= 2.0
    if compress:
        assert 1.9 <= fp8.num_query_slots / bf16.num_query_slots <= 2.0
        # The query slots stay in the compute dtype.
        assert fp8.query_slot_bytes == bf16.query_slot_bytes


def test_simulator_and_engine_plan_the_same_fp8_capacity():
    """Both twins call plan_capacity; the simulator from the hardware table, the engine from its device."""
    from zipage.sim.simulate import plan_deployment

    settings = ReplaySettings(model="qwen3-8b", hardware="h200", kv_memory_gb=6.0,
                              config=ZipageConfig(kv_cache_dtype="fp8", block_size=64, kv_budget=512))
    simulated = plan_deployment(settings).capacity
    engine = plan_capacity(settings, get_preset("qwen3-8b"), None)
    assert simulated == engine
    assert simulated.num_blocks == plan_memory(get_preset("qwen3-8b"), settings.config, 6 * GIB, 2).num_blocks


def test_analytic_cost_model_prices_halved_kv_reads():
    from zipage.hardware import get_hardware
    from zipage.sim.analytic import AnalyticCostModel

    shape, gpu = get_preset("qwen3-8b"), get_hardware("h200")
    bf16 = AnalyticCostModel(shape, gpu)
    fp8 = AnalyticCostModel(shape, gpu, kv_cache_dtype="fp8")
    assert fp8.kv_bytes_per_token / bf16.kv_bytes_per_token == pytest.approx(132 / 256, rel=1e-12)
    # A long-context decode step is KV-bound: fp8 makes it faster, never slower.
    assert fp8.decode_time_for(128, 128 * 8192) < bf16.decode_time_for(128, 128 * 8192)
    assert fp8.compress_time_for([9] * 8) < bf16.compress_time_for([9] * 8)


# ---------------------------------------------------------------- the engine makes the simulator's decisions


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-qwen3-fp8")
    save_tiny_qwen3(directory)
    return directory


def test_cpu_engine_and_simulator_make_the_same_decisions_with_fp8(tiny_model, tmp_path):
    """Compression on, synchronous, a cache small enough that the fp8 capacity decides who waits."""
    requests = [TraceRequest(id=f"r{i}", arrival_s=0.0, prompt_len=length, output_len=output,
                             prefix_group="g" if i % 2 else None, prefix_len=16 if i % 2 else 0)
                for i, (length, output) in enumerate([(20, 60), (33, 40), (5, 70), (40, 30), (17, 50)])]
    trace_path = tmp_path / "trace.json"
    save_trace(Trace("fp8", requests), trace_path)
    common = ["replay", str(trace_path), "--model", str(tiny_model), "--block-size", "16", "--window", "4",
              "--budget", "32", "--no-async", "--dtype", "float32", "--kv-cache-dtype", "fp8",
              "--kv-memory-gb", "0.00012", "--json"]
    runs = {}
    for run, extra in (("sim", []), ("cpu", ["--engine", "cpu"])):
        result = subprocess.run([sys.executable, "-m", "zipage.cli", *common, *extra, "--out", str(tmp_path / run)],
                                capture_output=True, text=True, cwd=ROOT)
        assert result.returncode == 0, result.stderr
        runs[run] = json.loads(result.stdout)
    assert runs["sim"]["num_blocks"] == runs["cpu"]["num_blocks"]
    assert runs["sim"]["max_concurrency"] == runs["cpu"]["max_concurrency"]
    assert runs["cpu"]["compressions"] > 0
    assert runs["cpu"]["settings"]["config"]["kv_cache_dtype"] == "fp8"
    assert read_decisions(tmp_path / "sim") == read_decisions(tmp_path / "cpu")
