"""Async scheduling on the CPU engine (docs/architecture.md, 'Async scheduling'): each step is
planned while the one before runs, its decode rows take that step's tokens on the device, and an
end-of-sequence stop applies one step later. The tokens must be the synchronous engine's, through
preemption, prefix-cache hits, compression, chunked and whole-prompt prefill, stops and aborts;
and with no stop, every decision too."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_models import save_tiny_qwen3  # noqa: E402

from zipage import LLM, SamplingParams  # noqa: E402
from zipage.errors import ConfigError  # noqa: E402

NEW_TOKENS = 40
# 14 blocks of 16 tokens for the tiny model (fp32): the requests below preempt and recompute.
BLOCK_BYTES = 2 * 2 * 2 * 32 * 4 * 16


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-qwen3")
    save_tiny_qwen3(directory)
    return directory


def prompts():
    generator = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 256, (40,), generator=generator).tolist()
    tails = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (1, 9, 20)]
    alone = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (5, 33, 70)]
    return [shared + tail for tail in tails] + alone


def generate(directory, sampling, async_scheduling: bool, eos: int | None = None, **knobs):
    llm = LLM(str(directory), block_size=16, async_scheduling=async_scheduling, **knobs)
    if eos is not None:  # the tiny model's own end-of-sequence id is never sampled
        llm._eos_ids = lambda: frozenset({eos})
    outputs = llm.generate(prompts(), sampling, progress=False)
    return llm, outputs


SETTINGS = {
    "full-kv, preempting": dict(compress=False, kv_memory_gb=14 * BLOCK_BYTES / 1024**3),
    "full-kv, whole prompts": dict(compress=False, kv_memory_gb=0.01, chunked_prefill=False),
    "compressing": dict(kv_budget=32, window=4, kv_memory_gb=0.01),
    "compressing, sync batches": dict(kv_budget=32, window=4, kv_memory_gb=0.01,
                                      async_compress=False),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_async_scheduling_gives_the_synchronous_tokens_and_decisions(tiny_model, name):
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    sync_llm, sync = generate(tiny_model, greedy, False, **SETTINGS[name])
    async_llm, asynchronous = generate(tiny_model, greedy, True, **SETTINGS[name])
    assert [o.token_ids for o in asynchronous] == [o.token_ids for o in sync]
    assert all(o.finish_reason == "length" for o in asynchronous)
    # No stop and no async compression batch (whose end the next plan cannot know yet: it
    # is known one step later, like a stop): the plans are the synchronous ones, step for step.
    sync_steps, async_steps = sync_llm.last_run.steps, async_llm.last_run.steps
    if name != "compressing":
        assert [(s.kind, s.n_decode, s.prefill_tokens, s.n_compress) for s in async_steps] == \
            [(s.kind, s.n_decode, s.prefill_tokens, s.n_compress) for s in sync_steps]
    if name == "full-kv, preempting":
        assert async_llm.last_run.summary["preemptions"] > 0
    if name.startswith("compressing"):
        assert async_llm.last_run.summary["compressions"] > 0
    # Steps follow one another on the run's clock (a step planned while the one before ran
    # starts when that one ended).
    for before, after in zip(async_steps, async_steps[1:]):
        assert after.t_start >= before.t_end - 1e-9


@pytest.mark.parametrize("name", ["full-kv, preempting", "compressing"])
def test_a_stop_applies_one_step_later_and_its_extra_token_is_dropped(tiny_model, name):
    """Requests stop at a token they sample often: each output is the synchronous one, cut at
    the same stop; the requests stopped are the same."""
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    _, free = generate(tiny_model, greedy, False, **SETTINGS[name])
    counts = torch.bincount(torch.tensor([t for o in free for t in o.token_ids]))
    stop_token = int(counts.argmax())
    stopping = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    _, sync = generate(tiny_model, stopping, False, eos=stop_token, **SETTINGS[name])
    _, asynchronous = generate(tiny_model, stopping, True, eos=stop_token, **SETTINGS[name])
    assert any(o.finish_reason == "stop" for o in sync)
    assert [(o.token_ids, o.finish_reason) for o in asynchronous] == \
        [(o.token_ids, o.finish_reason) for o in sync]


def test_steps_that_need_their_tokens_on_the_host_run_synchronously(tiny_model):
    """Penalties read the tokens so far on the host, log-probabilities are computed with the
    step: such steps wait for the step before; the tokens are the synchronous engine's."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                            repetition_penalty=1.3, logprobs=2)
    _, sync = generate(tiny_model, params, False, compress=False, kv_memory_gb=0.01)
    _, asynchronous = generate(tiny_model, params, True, compress=False, kv_memory_gb=0.01)
    assert [o.token_ids for o in asynchronous] == [o.token_ids for o in sync]
    assert [len(o.logprobs) for o in asynchronous] == [12] * len(sync)


def test_teacher_forcing_refuses_async_scheduling(tiny_model):
    from zipage.engine.loop import EngineLoop

    llm = LLM(str(tiny_model), block_size=16, compress=False, kv_memory_gb=0.01,
              async_scheduling=True)
    with pytest.raises(ConfigError, match="async_scheduling"):
        EngineLoop(llm.engine.new_scheduler(), llm.engine.runner, next_token=lambda s, t: t)


def test_each_step_is_reported_settled_in_exactly_one_output(tiny_model):
    """As a server drives the loop (`step()` until it is not busy, a request added between
    steps): each plan's result is applied in exactly one output's `plans` (none for a step only
    launched, two when a step run at once follows the one settled), which is what the server
    counts compressions, preemptions and prompt tokens from, and each request is in exactly one
    output's `finished`, which is how the server ends its stream."""
    from zipage.core.sequence import Sequence
    from zipage.engine.loop import EngineLoop

    llm = LLM(str(tiny_model), block_size=16, async_scheduling=True, **SETTINGS["compressing"])
    loop = EngineLoop(llm.engine.new_scheduler(), llm.engine.runner, log_decisions=True)
    loop.start()
    plain = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    penalized = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                               repetition_penalty=1.2)  # its steps run at once (`needs_sync`)
    waiting = [Sequence(f"r{i}", prompt, NEW_TOKENS, sampling=penalized if i == 3 else plain)
               for i, prompt in enumerate(prompts())]
    settled, finished, outputs, sizes = [], [], 0, set()
    ids = [seq.seq_id for seq in waiting]
    while waiting or loop.busy:
        if waiting and outputs % 3 == 0:
            loop.add(waiting.pop(0))
        output = loop.step()
        outputs += 1
        if output is not None:
            settled.extend(plan.step_id for plan in output.plans)
            finished.extend(seq.seq_id for seq in output.finished)
            sizes.add(len(output.plans))
    assert sizes == {0, 1, 2}
    # Each request reported finished once, in the output that settles its last step (a length
    # finish is found when that step is advanced, before it settles).
    assert sorted(finished) == sorted(ids)
    assert len(settled) == len(loop.recorder.result().steps)
    assert sorted(settled) == sorted(set(settled))
    assert all(len(seq) for seq in loop.tokens.values())
