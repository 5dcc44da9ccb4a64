"""The real engine on the CPU: `LLM.generate` against HF transformers, under memory pressure
(recompute preemption), with prefix-cache hits, with a request that fails alone, and
`zipage replay --engine cpu` making the simulator's decisions step for step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiny_models import save_tiny_qwen3  # noqa: E402

from zipage import LLM, SamplingParams  # noqa: E402
from zipage.rundir import read_decisions  # noqa: E402
from zipage.trace import Trace, TraceRequest, save_trace  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny random Qwen3 saved as a HF directory, and the HF model itself as the reference."""
    directory = tmp_path_factory.mktemp("tiny-qwen3")
    return directory, save_tiny_qwen3(directory)


def hf_greedy(model, prompts, new_tokens):
    outputs = []
    for prompt in prompts:
        generated = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                                   min_new_tokens=new_tokens, do_sample=False)
        outputs.append(generated[0, len(prompt):].tolist())
    return outputs


def prompts_with_shared_prefix():
    generator = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 256, (40,), generator=generator).tolist()
    tails = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (1, 9, 20)]
    alone = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (5, 33)]
    return [shared + tail for tail in tails] + alone


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_generate_matches_hf_greedy(tiny_model):
    directory, reference = tiny_model
    prompts = prompts_with_shared_prefix()
    llm = LLM(str(directory), compress=False, block_size=16, kv_memory_gb=0.01)
    outputs = llm.generate(prompts, GREEDY, progress=False)
    assert [output.token_ids for output in outputs] == hf_greedy(reference, prompts, NEW_TOKENS)
    assert all(output.finish_reason == "length" for output in outputs)


def test_preemption_and_prefix_cache_do_not_change_tokens(tiny_model):
    directory, reference = tiny_model
    prompts = prompts_with_shared_prefix()
    expected = hf_greedy(reference, prompts, NEW_TOKENS)
    # 14 blocks of 16 tokens: the five requests need up to 6 blocks each, so some are preempted
    # and recomputed; the 40-token shared prefix is served from the prefix cache.
    block_bytes = 2 * 2 * 2 * 32 * 4 * 16  # K+V, 2 layers, 2 kv heads, head_dim 32, fp32, 16 tokens
    for prefix_cache in (True, False):
        llm = LLM(str(directory), compress=False, block_size=16, prefix_cache=prefix_cache,
                  kv_memory_gb=14 * block_bytes / 1024**3)
        assert llm.engine.capacity.num_blocks == 14
        outputs = llm.generate(prompts, GREEDY, progress=False)
        assert [output.token_ids for output in outputs] == expected
        assert llm.last_run.summary["preemptions"] > 0
        cached_prefills = [s for s in llm.last_run.steps if s.kind == "prefill"]
        assert cached_prefills


def test_prefix_cache_hits_are_used(tiny_model):
    directory, _ = tiny_model
    prompts = prompts_with_shared_prefix()
    llm = LLM(str(directory), compress=False, block_size=16, kv_memory_gb=0.01,
              max_num_seqs=1)  # one at a time: later requests find the prefix cached
    loop_outputs = llm.generate(prompts, GREEDY, progress=False)
    computed = sum(step.prefill_tokens for step in llm.last_run.steps)
    assert computed < sum(len(prompt) for prompt in prompts)  # some prompt blocks were hits
    uncached = LLM(str(directory), compress=False, block_size=16, kv_memory_gb=0.01,
                   max_num_seqs=1, prefix_cache=False).generate(prompts, GREEDY, progress=False)
    assert [o.token_ids for o in loop_outputs] == [o.token_ids for o in uncached]


def test_bad_request_fails_alone(tiny_model):
    directory, _ = tiny_model
    llm = LLM(str(directory), compress=False, block_size=16, kv_memory_gb=0.01)
    outputs = llm.generate([[1, 2, 3], list(range(500)) * 1 + [1] * 20],
                           GREEDY, progress=False)
    assert outputs[0].finish_reason == "length" and len(outputs[0].token_ids) == NEW_TOKENS
    assert outputs[1].finish_reason == "error" and "max_model_len" in outputs[1].error


def replay_sim_and_cpu(directory: Path, tmp_path: Path, name: str, shapes: list[tuple[int, int]],
                       *flags: str) -> dict[str, dict]:
    """Replay requests of these (prompt, output) lengths, every other one sharing a 16-token prefix,
    through the simulator and the CPU engine with the same flags (Full KV, block 16, a cache small
    enough to preempt, `flags`); their summaries, keyed "sim" and "cpu", run directories under
    `tmp_path / key`."""
    requests = [TraceRequest(id=f"r{i}", arrival_s=0.0, prompt_len=length, output_len=output,
                             prefix_group="g" if i % 2 else None, prefix_len=16 if i % 2 else 0)
                for i, (length, output) in enumerate(shapes)]
    trace_path = tmp_path / "trace.json"
    save_trace(Trace(name, requests), trace_path)
    common = ["replay", str(trace_path), "--model", str(directory), "--no-compress",
              "--block-size", "16", "--dtype", "float32", "--kv-memory-gb", "0.0001", *flags,
              "--json"]
    runs = {}
    for run, extra in (("sim", []), ("cpu", ["--engine", "cpu"])):
        result = subprocess.run([sys.executable, "-m", "zipage.cli", *common, *extra, "--out",
                                 str(tmp_path / run)], capture_output=True, text=True, cwd=ROOT)
        assert result.returncode == 0, result.stderr
        runs[run] = json.loads(result.stdout)
    return runs


def test_engine_and_simulator_make_the_same_decisions(tiny_model, tmp_path):
    directory, _ = tiny_model
    runs = replay_sim_and_cpu(directory, tmp_path, "engine-vs-sim",
                              [(20, 30), (33, 12), (5, 50), (40, 8), (17, 25), (64, 3)])
    assert set(runs["sim"]) == set(runs["cpu"])
    assert runs["sim"]["num_blocks"] == runs["cpu"]["num_blocks"]
    assert runs["cpu"]["preemptions"] > 0  # the cache is small enough to force recompute
    sim_log = read_decisions(tmp_path / "sim")
    assert sim_log and sim_log == read_decisions(tmp_path / "cpu")
    for name in ("steps.csv", "requests.csv", "timeline.png", "summary.json"):
        assert (tmp_path / "cpu" / name).stat().st_size > 0


def test_cli_generate_with_token_ids(tiny_model):
    directory, reference = tiny_model
    prompt = [5, 17, 33, 2]
    result = subprocess.run(
        [sys.executable, "-m", "zipage.cli", "generate", "ids:" + ",".join(map(str, prompt)),
         "--model", str(directory), "--max-tokens", "12", "--ignore-eos", "--no-compress",
         "--block-size", "16", "--kv-memory-gb", "0.01"],
        capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    expected = hf_greedy(reference, [prompt], 12)[0]
    assert result.stdout.split() == [str(token) for token in expected]
