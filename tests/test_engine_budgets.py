"""Per-request and elastic budgets in the real engine on the CPU (docs/architecture.md,
'Per-request and elastic budgets'): requests with budgets of their own compressed side by side in
one batch give the tokens each gives alone (the compressor's target count per job, sync and
async); the elastic policy with memory to spare gives exactly Full KV's tokens, where the fixed
policy does not; `SamplingParams.kv_budget` is checked like every field."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_models import save_tiny_qwen3  # noqa: E402
from tolerance import assert_close  # noqa: E402

from zipage import LLM, SamplingParams  # noqa: E402
from zipage.errors import ConfigError  # noqa: E402

NEW_TOKENS = 60
KNOBS = dict(block_size=16, window=4, kv_budget=32, prefix_cache=False)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-qwen3")
    save_tiny_qwen3(directory)
    return str(directory)


def prompts():
    """Lengths that bring the budgets 16, 48 and 32 (N_max 2, 4, 3 blocks of 16) to their first
    compression in the same step, so their compressions run in one batch, every time."""
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (5, 37, 21)]


def greedy(kv_budget=None):
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                          kv_budget=kv_budget)


@pytest.mark.parametrize("async_compress", [False, True])
def test_budgets_side_by_side_give_the_tokens_each_gives_alone(tiny_model, async_compress):
    llm = LLM(tiny_model, kv_memory_gb=0.01, async_compress=async_compress, **KNOBS)
    compressor = llm.engine.runner.compressor
    pipeline, target_counts = compressor.compress_fn, []

    def recording(*positional, **arguments):
        target_counts.append(arguments["num_target_blocks"].tolist())
        pipeline(*positional, **arguments)

    compressor.compress_fn = recording
    budgets = [16, 48, None]
    together = llm.generate(prompts(), [greedy(budget) for budget in budgets], progress=False)
    kept = {record.id: record.kept_budget for record in llm.last_run.requests}
    assert_close(kept, {"0": 16, "1": 48, "2": 32})
    # Some batches compressed requests of different budgets together (1, 3 and 2 target blocks).
    assert any(len(set(counts)) == 3 for counts in target_counts)
    compressor.compress_fn = pipeline
    alone = [llm.generate([prompt], greedy(budget), progress=False)[0].token_ids
             for prompt, budget in zip(prompts(), budgets)]
    assert [output.token_ids for output in together] == alone
    # The budgets matter: the default for all gives other tokens.
    default = llm.generate(prompts(), greedy(), progress=False)
    assert [output.token_ids for output in default] != alone


def test_elastic_with_memory_to_spare_is_full_kv(tiny_model):
    full = LLM(tiny_model, kv_memory_gb=0.01, compress=False, **KNOBS)
    elastic = LLM(tiny_model, kv_memory_gb=0.01, budget_policy="elastic", **KNOBS)
    fixed = LLM(tiny_model, kv_memory_gb=0.01, **KNOBS)
    reference = [output.token_ids for output in full.generate(prompts(), greedy(), progress=False)]
    tokens = [output.token_ids for output in elastic.generate(prompts(), greedy(), progress=False)]
    assert elastic.last_run.summary["compressions"] == 0
    assert tokens == reference
    assert elastic.last_run.summary["mean_kept_budget"] > 32
    compressed = [output.token_ids for output in fixed.generate(prompts(), greedy(),
                                                                 progress=False)]
    assert fixed.last_run.summary["compressions"] > 0 and compressed != reference


def test_a_bad_request_budget_is_refused_by_name(tiny_model):
    with pytest.raises(ConfigError, match=r"^kv_budget: must be an integer between 1 and .*, got 0"):
        SamplingParams(kv_budget=0)
    with pytest.raises(ConfigError, match=r"^kv_budget: must be an integer .*, got True"):
        SamplingParams(kv_budget=True)
    llm = LLM(tiny_model, kv_memory_gb=0.01, **KNOBS)
    bad, good = llm.generate(prompts()[:2], [greedy(40), greedy(16)], progress=False)
    assert bad.finish_reason == "error" and "kv_budget 40 must be a positive multiple" in bad.error
    assert good.finish_reason == "length" and len(good.token_ids) == NEW_TOKENS
