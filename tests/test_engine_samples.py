"""Samples of one prompt and log-probabilities on the real engine (CPU, the SmolLM2 GGUF):
`SamplingParams(n=...)` prefills the prompt once and forks the other samples (the fork's copy of
the partial last block is checked by greedy samples equal to the unforked output, through a
compression); `logprobs` and `prompt_logprobs` equal the log-softmax of transformers' logits on
the same GGUF file.

Tolerance: both models run in float32 on the CPU but through different kernels (our paged
attention's torch reference, transformers' eager attention) and summation orders; over 30
layers their logits differ by ~1e-5 relative. Log-probabilities are compared with an absolute
tolerance of 1e-3 (a 0.1 % relative error of a probability), far below any real error (a wrong
position or a missing token shifts them by > 0.1).
"""

from __future__ import annotations

import pytest
from smollm2 import GGUF, needs_smollm2

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from zipage.core.sampling import SamplingParams  # noqa: E402

LOGPROB_ATOL = 1e-3
KNOBS = dict(block_size=16, kv_budget=64, window=4, max_model_len=2048, max_num_seqs=16)
PROMPT = "The capital of France is a city that many people"
pytestmark = needs_smollm2


@pytest.fixture(scope="module")
def llm(one_cpu_thread):
    from zipage.engine.llm import LLM

    return LLM(str(GGUF), device="cpu", dtype="float32", kv_memory_gb=0.25, threads=1, **KNOBS)


def test_n_8_prefills_once_and_returns_8_samples(llm):
    out = llm.generate([PROMPT], SamplingParams(n=8, temperature=0.8, seed=1, max_tokens=5),
                       progress=False)[0]
    prompt_len = len(out.prompt_token_ids)
    assert prompt_len % 16 != 0  # the forks copy the partial last block
    assert [sample.index for sample in out.outputs] == list(range(8))
    assert all(len(sample.token_ids) == 5 for sample in out.outputs)
    steps = llm.last_run.steps
    assert sum(step.prefill_tokens for step in steps) == prompt_len  # one prefill, not eight
    assert steps[0].n_prefill == 1 and steps[0].n_running == 8
    assert len({tuple(sample.token_ids) for sample in out.outputs}) > 1  # own seeds
    again = llm.generate([PROMPT], SamplingParams(n=8, temperature=0.8, seed=1, max_tokens=5),
                         progress=False)[0]
    assert [s.token_ids for s in again.outputs] == [s.token_ids for s in out.outputs]


def test_forked_greedy_samples_equal_the_unforked_output_through_compression(llm):
    greedy = dict(temperature=0.0, max_tokens=90, ignore_eos=True)
    alone = llm.generate([PROMPT], SamplingParams(**greedy), progress=False)[0]
    forked = llm.generate([PROMPT], SamplingParams(n=3, **greedy), progress=False)[0]
    assert llm.last_run.summary["compressions"] >= 3  # every sample compressed its copy too
    for sample in forked.outputs:
        assert sample.token_ids == alone.token_ids


def test_logprobs_equal_transformers_log_softmax(llm):
    from transformers import AutoModelForCausalLM

    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3,
                                                prompt_logprobs=2), progress=False)[0]
    reference = AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name,
                                                     dtype=torch.float32).eval()
    ids = out.prompt_token_ids + out.token_ids
    with torch.inference_mode():
        logits = reference(torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)  # row t predicts token t + 1
    prompt_len = len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == prompt_len
    entries = out.prompt_logprobs[1:] + out.logprobs
    assert len(entries) == len(ids) - 1
    for position, entry in enumerate(entries, start=1):
        row = expected[position - 1]
        assert entry.token_id == ids[position]
        assert abs(entry.logprob - row[ids[position]].item()) < LOGPROB_ATOL
        wanted = 2 if position < prompt_len else 3
        assert len(entry.top) == wanted
        assert entry.top[0][0] == row.argmax().item()
        for top_id, value in entry.top:
            assert abs(value - row[top_id].item()) < LOGPROB_ATOL
        assert [value for _, value in entry.top] == sorted((v for _, v in entry.top),
                                                           reverse=True)
    # Greedy: every output token is the most likely one.
    assert all(entry.token_id == entry.top[0][0] for entry in out.logprobs)


def test_sampling_params_bounds():
    from zipage.errors import ConfigError

    for field, bad in (("n", 0), ("n", 129), ("n", 2.0), ("logprobs", -1), ("logprobs", 21),
                       ("prompt_logprobs", True)):
        with pytest.raises(ConfigError, match=f"^{field}:"):
            SamplingParams(**{field: bad})


def test_engine_and_simulator_fork_alike(tmp_path_factory, one_cpu_thread):
    """The twins share the fork rule: groups of samples under compression and preemption make
    the same decisions (forks included) on the real engine (a tiny random Qwen3, every invariant
    checked) and in the simulator (random step times: sync compression does not depend on
    them); and forked greedy samples equal the request run alone."""
    from test_simulator import RandomCostModel
    from tiny_models import save_tiny_qwen3

    from zipage.core.scheduler import Scheduler
    from zipage.engine.llm import LLM, sample_sequences
    from zipage.engine.loop import EngineLoop
    from zipage.sim.simulator import Simulator

    directory = tmp_path_factory.mktemp("tiny-qwen3")
    save_tiny_qwen3(directory)
    # 14 blocks of 16 tokens, 2 slots (N_max 3): eight samples cannot all keep their KV.
    block_bytes = 2 * 2 * 2 * 32 * 4 * 16
    llm = LLM(str(directory), block_size=16, kv_budget=32, window=4, async_compress=False,
              kv_memory_gb=16 * block_bytes / 1024**3, threads=1)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (21, 7, 32)]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    def groups():
        return [seq for index, (prompt, n) in enumerate(zip(prompts, (4, 3, 2)))
                for seq in sample_sequences(str(index), prompt, SamplingParams(
                    temperature=0.0, max_tokens=40, ignore_eos=True, n=n))]

    loop = EngineLoop(llm.engine.new_scheduler(), llm.engine.runner, check=True,
                      log_decisions=True)
    engine_run = loop.run(groups())
    capacity = llm.engine.capacity
    simulated = Simulator(Scheduler(llm.engine.config, capacity.num_blocks,
                                    capacity.num_query_slots), RandomCostModel(3), check=True,
                          log_decisions=True).run(groups())
    assert engine_run.decision_log == simulated.decision_log
    log = "\n".join(engine_run.decision_log)
    assert "fork=" in log and engine_run.summary["preemptions"] > 0
    assert engine_run.summary["compressions"] > 0
    for index, prompt in enumerate(prompts):
        alone = llm.generate([prompt], greedy, progress=False)[0].token_ids
        samples = [tokens[len(prompt):] for seq_id, tokens in engine_run.tokens.items()
                   if seq_id.split("#")[0] == str(index)]
        assert samples and all(sample == alone for sample in samples)
