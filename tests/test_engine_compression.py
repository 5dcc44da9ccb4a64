"""Compression in the real engine (CPU, reference kernels): exact equality with Full KV when the
budget covers every request, the N_max cap from the engine's own metrics, and shared prefix blocks
left byte-identical by another request's compression (sync and async)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_engine import GREEDY, prompts_with_shared_prefix, tiny_model  # noqa: E402,F401

from zipage import LLM, SamplingParams  # noqa: E402
from zipage.core.sequence import Sequence  # noqa: E402
from zipage.engine.loop import EngineLoop  # noqa: E402

SMALL = dict(block_size=16, window=4, kv_budget=32, kv_memory_gb=0.002)


def test_budget_covering_every_request_equals_full_kv(tiny_model):  # noqa: F811
    directory, _ = tiny_model
    prompts = prompts_with_shared_prefix()
    full = LLM(str(directory), compress=False, block_size=16, kv_memory_gb=0.01)
    roomy = LLM(str(directory), block_size=16, window=4, kv_budget=128, kv_memory_gb=0.01)
    expected = full.generate(prompts, GREEDY, progress=False)
    outputs = roomy.generate(prompts, GREEDY, progress=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert roomy.last_run.summary["compressions"] == 0


@pytest.mark.parametrize("asynchronous", [False, True])
def test_compressed_requests_stay_under_n_max(tiny_model, asynchronous):  # noqa: F811
    directory, _ = tiny_model
    llm = LLM(str(directory), async_compress=asynchronous, **SMALL)
    outputs = llm.generate(prompts_with_shared_prefix(), GREEDY, progress=False)
    run = llm.last_run
    assert all(len(output.token_ids) == GREEDY.max_tokens for output in outputs)
    assert run.summary["compressions"] > 0
    n_max = llm.engine.config.n_max
    compressed = [r for r in run.requests if r.n_compressions]
    assert compressed and all(
        r.max_blocks_held_after_first_compression <= n_max for r in compressed)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_shared_prefix_blocks_survive_another_requests_compression(tiny_model, asynchronous):  # noqa: F811
    directory, _ = tiny_model
    # One request per prefill batch, so "short" finds "long"'s prompt blocks in the prefix cache.
    llm = LLM(str(directory), async_compress=asynchronous, max_num_batched_tokens=80, **SMALL)
    engine = llm.engine
    scheduler = engine.new_scheduler()
    runner = engine.runner
    shared = list(range(100, 148))  # three full 16-token blocks
    # "long" (78 tokens, 5 blocks) compresses at its 3rd decode; "short" (49 tokens) only at its
    # 15th, so "long" compresses while the two still share the prefix blocks.
    prompts = {"long": shared + list(range(1, 31)), "short": shared + [3]}
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    sequences = [Sequence("long", prompts["long"], 60, sampling=params),
                 Sequence("short", prompts["short"], 200, sampling=params)]
    snapshots: dict[int, torch.Tensor] = {}
    checked = []

    def watch(seq_id: str, token: int) -> int:
        # Every block "short" shares keeps its bytes for as long as "short" holds it unchanged
        # (not yet compressed or preempted itself), whatever "long" does meanwhile.
        short = sequences[1]
        if short.num_compressions or short.num_preemptions or short.compressing:
            return token
        for block in short.block_table[:3]:
            content = runner.kv_cache[:, :, block].clone()
            if block in snapshots:
                assert torch.equal(snapshots[block], content), f"shared block {block} changed"
                checked.append(sequences[0].num_compressions)
            elif scheduler.block_manager.refcount[block] > 1:
                snapshots[block] = content
        return token

    loop = EngineLoop(scheduler, runner, next_token=watch, check=True)
    run = loop.run(sequences)
    long_record = next(r for r in run.requests if r.id == "long")
    # Checks ran after "long" had compressed while "short" still shared its prefix blocks.
    assert long_record.n_compressions > 0 and snapshots and max(checked) > 0


def test_async_launch_goes_behind_the_forward(tiny_model, monkeypatch):  # noqa: F811
    """An async batch goes in behind its step's forward, and changes no token: the batch's
    requests are not in that forward."""
    directory, _ = tiny_model
    sync = LLM(str(directory), async_compress=False, **SMALL)
    expected = [o.token_ids for o in sync.generate(prompts_with_shared_prefix(), GREEDY,
                                                   progress=False)]
    llm = LLM(str(directory), **SMALL)
    runner, events = llm.engine.runner, []
    for name in ("execute", "_decode", "_prefill"):
        forward = getattr(runner, name)
        monkeypatch.setattr(runner, name, lambda *a, forward=forward, name=name:
                            events.append(name) or forward(*a))
    launch = runner.compressor.launch
    monkeypatch.setattr(runner.compressor, "launch",
                        lambda batch: events.append("launch") or launch(batch))
    outputs = llm.generate(prompts_with_shared_prefix(), GREEDY, progress=False)
    assert [o.token_ids for o in outputs] == expected
    launches = [index for index, event in enumerate(events) if event == "launch"]
    assert launches and llm.last_run.summary["compressions"] > 0
    # Within its step ("execute" opens one), a launch comes right after the step's forward.
    assert {events[i - 1] for i in launches} <= {"_decode", "_prefill"}
