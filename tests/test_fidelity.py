"""The fidelity harness (`zipage.analysis.fidelity`) on a tiny random Qwen3: no compression means
exact agreement, real compression means less, and the baselines keep exactly what they claim."""

from __future__ import annotations

import csv
import dataclasses
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiny_models import save_tiny_qwen3  # noqa: E402

from zipage.analysis import fidelity  # noqa: E402
from zipage.config import ZipageConfig  # noqa: E402
from zipage.engine.loader import load_model  # noqa: E402
from zipage.kernels.compress_ref import CompressionParams  # noqa: E402

NEW_TOKENS = 64
BLOCK = 16


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: the tiny model's ops are far too small to split, and on a busy CPU the
    thread hand-offs alone make these tests several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny random Qwen3 saved as a HF directory and loaded by our loader (float32, CPU)."""
    directory = tmp_path_factory.mktemp("tiny-qwen3-fidelity")
    # Larger weights than test_engine's: sharper attention, so which entries are evicted changes
    # the logits visibly.
    save_tiny_qwen3(directory, weight_std=0.3)
    loaded, shape, _ = load_model(str(directory), torch.float32, "cpu")
    return str(directory), loaded, shape


@pytest.fixture(scope="module")
def reference(tiny_model):
    spec, model, shape = tiny_model
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (length,), generator=generator).tolist()
               for length in (20, 37)]
    engine = fidelity.build_engine(
        model, shape, None, spec, ZipageConfig(block_size=BLOCK, compress=False,
                                               prefix_cache=False),
        len(prompts), 37 + NEW_TOKENS)
    return fidelity.generate_reference(engine, prompts, NEW_TOKENS, temperature=0.7, seed=0)


def compressed_engine(tiny_model, budget: int, num_requests: int, window: int = 4):
    spec, model, shape = tiny_model
    config = ZipageConfig(block_size=BLOCK, window=window, kv_budget=budget,
                          async_compress=False, prefix_cache=False)
    return fidelity.build_engine(model, shape, None, spec, config, num_requests,
                                 37 + NEW_TOKENS)


def test_reference_has_every_position(reference):
    assert [len(output) for output in reference.outputs] == [NEW_TOKENS, NEW_TOKENS]
    for log_probs in reference.log_probs:
        assert torch.isfinite(log_probs).all()
        assert torch.allclose(log_probs.exp().sum(dim=-1), torch.ones(NEW_TOKENS), atol=1e-4)


def test_budget_covering_the_sequence_matches_full_kv(tiny_model, reference):
    engine = compressed_engine(tiny_model, budget=256, num_requests=2 * len(fidelity.VARIANTS))
    results = fidelity.teacher_force(engine, reference, fidelity.VARIANTS)
    for result in results:
        assert result.first_compression == [None, None]  # 37 + 64 tokens < 256: never compressed
        assert bool(result.agreement.all()), result.variant
        assert float(result.kl.abs().max()) < 1e-5, result.variant
        assert not result.compressed_mask().any()


def test_real_compression_loses_agreement(tiny_model, reference):
    variants = [variant for variant in fidelity.VARIANTS
                if variant.name in (fidelity.RECOMMENDED, "baseline: random")]
    engine = compressed_engine(tiny_model, budget=32, num_requests=2 * len(variants))
    results = fidelity.teacher_force(engine, reference, variants)
    repeated = torch.stack([fidelity.repeated_positions(prompt, output) for prompt, output
                            in zip(reference.prompts, reference.outputs)])
    for result in results:
        # Compression runs before the step that computes KV entry 48 (a 4th block with N_max = 3
        # full), and that step predicts output number 49 - prompt length.
        assert result.first_compression == [3 * BLOCK + 1 - 20, 3 * BLOCK + 1 - 37]
        mask = result.compressed_mask()
        # Before the first compression the cache is exactly Full KV.
        assert bool(result.agreement[~mask].all())
        assert float(result.kl[~mask].abs().max()) < 1e-5
        assert float(result.kl[mask].mean()) > 1e-3
        row = fidelity.summarize(result, 32, repeated)
        assert row["compressed_positions"] == int(mask.sum())
        assert row["agreement"] < 1.0
        assert row["agreement"] == pytest.approx(float(result.agreement[mask].double().mean()))
    table = fidelity.markdown_table([fidelity.summarize(result, 32, repeated)
                                     for result in results], [32])
    assert "| recommended |" in table and "| baseline: random |" in table


def numbered_cache(num_blocks: int, heads: int = 2, dim: int = 3):
    """K and V caches of one layer whose every entry holds its own global slot number."""
    slots = torch.arange(num_blocks * BLOCK, dtype=torch.float32)
    k_cache = slots.view(1, num_blocks, BLOCK, 1, 1).expand(1, num_blocks, BLOCK, heads,
                                                           dim).clone()
    return k_cache, k_cache.clone() + 1000


def run_baseline(policy, source_blocks: list[int], target_blocks: list[int], window: int = 4):
    k_cache, v_cache = numbered_cache(8)
    params = CompressionParams(block_size=BLOCK, window=window)
    policy(k_cache, v_cache, None, torch.zeros(1, 1, window, 4, 3),
           source_tables=torch.tensor([source_blocks]),
           num_source_blocks=torch.tensor([len(source_blocks)]),
           target_tables=torch.tensor([target_blocks]), query_slots=torch.tensor([0]),
           is_compressed=torch.tensor([False]), params=params, scale=1.0)
    return k_cache, v_cache


def entries_of(blocks: list[int]) -> list[int]:
    return [block * BLOCK + offset for block in blocks for offset in range(BLOCK)]


def test_sink_recent_keeps_the_first_four_and_the_most_recent():
    source, target = [5, 2, 7], [5, 2]  # the request's blocks, the first two receive the kept
    k_cache, v_cache = run_baseline(fidelity.sink_recent_compress, source, target)
    sequence = entries_of(source)
    expected = sequence[:4] + sequence[-(2 * BLOCK - 4):]
    kept = k_cache[0, target].flatten(0, 1)  # [2 * BLOCK, heads, dim]
    for head in range(2):
        assert kept[:, head, 0].long().tolist() == expected
    assert (v_cache[0, target].flatten(0, 1)[:, 0, 0] - 1000).long().tolist() == expected


def test_random_eviction_keeps_the_window_in_order_and_repeats_with_its_seed():
    source, target = [1, 3, 4, 6], [1, 3]
    first = run_baseline(fidelity.RandomEviction(seed=7), source, target)[0]
    again = run_baseline(fidelity.RandomEviction(seed=7), source, target)[0]
    other = run_baseline(fidelity.RandomEviction(seed=8), source, target)[0]
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    sequence = entries_of(source)
    for head in range(2):
        kept = first[0, target].flatten(0, 1)[:, head, 0].long().tolist()
        assert kept == sorted(kept) and len(set(kept)) == 2 * BLOCK
        assert set(kept) <= set(sequence)
        assert kept[-4:] == sequence[-4:]  # the window survives every policy
    heads = first[0, target].flatten(0, 1)[:, :, 0]
    assert not torch.equal(heads[:, 0], heads[:, 1])  # drawn per kv head


def test_repeated_positions_mark_text_a_copy_predicts():
    prompt, output = [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 1, 2]
    # Output 4 closes the 5-gram 1 2 3 4 5 of the prompt; 1 2 after the 6 is too short to count.
    expected = [False] * 4 + [True] + [False] * 3
    assert fidelity.repeated_positions(prompt, output).tolist() == expected
    assert fidelity.repeated_positions([], [7] * 7).tolist() == [False] * 5 + [True] * 2


def test_report_rebuilds_tables_from_saved_files(tmp_path):
    prompts, outputs = [[1, 2, 3]], [[4, 5, 6, 7]]
    (tmp_path / "reference.json").write_text(json.dumps(
        {"prompt_token_ids": prompts, "output_token_ids": outputs}))
    result = fidelity.VariantResult("v", torch.tensor([[True, True, False, True]]),
                                    torch.tensor([[0.0, 0.0, 1.0, 3.0]], dtype=torch.float64), [2])
    torch.save({128: {"v": dataclasses.asdict(result)}}, tmp_path / "per_position.pt")
    markdown = fidelity.write_report(tmp_path)
    assert "| v | 0.500 | 2.000 | 0.500 | 2.000 |" in markdown  # positions 2 and 3 only
    rows = list(csv.DictReader(open(tmp_path / "fidelity.csv")))
    assert rows[0]["compressed_positions"] == "2" and rows[0]["budget"] == "128"


def test_budgets_per_request_and_by_prompt_length(tiny_model, reference):
    """teacher_force with a budget per request: the one that covers its sequence is exactly Full
    KV, the small one compresses where the engine's default would; budgets by prompt length
    average the fixed budget whole-block by whole-block."""
    from zipage.analysis.fidelity_budgets import budgets_by_prompt_length

    engine = compressed_engine(tiny_model, budget=32, num_requests=2)
    runs = []
    (result,) = fidelity.teacher_force(engine, reference, [fidelity.Variant("mixed")],
                                       budgets=[[256, 32]], runs=runs)
    assert result.first_compression == [None, 3 * BLOCK + 1 - 37]
    assert bool(result.agreement[0].all()) and float(result.kl[0].abs().max()) < 1e-5
    assert {record.id: record.kv_budget for record in runs[0].requests} == {"0/0": 256,
                                                                         "0/1": 32}
    assert budgets_by_prompt_length([48, 47, 48, 48, 277, 277], 256, 16) == (
        176, 176, 176, 176, 416, 416)
    assert budgets_by_prompt_length([300], 64, 16) == (320,)  # at least one block of tail
