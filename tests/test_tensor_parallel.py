"""Tensor parallelism on the CPU (gloo, one process per rank): TP=2 generates exactly the greedy
tokens of TP=1 in float32 on tiny Qwen3 / Qwen2 / Llama models (the Llama has one KV head, so
TP=2 replicates it) and on random SmolLM2 weights at TP=3, with Full KV and with compression
(sync and async), keeps exactly the tokens TP=1 keeps (the caches match, head by head), makes
the simulator's decisions, and fails with one line naming the rank when a worker raises or dies.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from zipage import LLM, SamplingParams  # noqa: E402
from zipage.config import ZipageConfig  # noqa: E402
from zipage.core.deployment import ReplaySettings  # noqa: E402
from zipage.engine.distributed import ShardGroup  # noqa: E402
from zipage.engine.layers import RMSNorm  # noqa: E402
from zipage.engine.loader import build_model, initialise_random  # noqa: E402
from zipage.engine.parallel import TensorParallelError, rank_devices  # noqa: E402
from zipage.engine.replay import replay_on_engine  # noqa: E402
from zipage.engine.sharding import ShardLayout, _random_full_tensors, check_tensor_parallel, valid_sizes  # noqa: E402
from zipage.errors import ConfigError  # noqa: E402
from zipage.kernels.compress_ref import CompressionParams, compress_ref  # noqa: E402
from zipage.presets import get_preset  # noqa: E402
from zipage.rundir import read_decisions  # noqa: E402
from zipage.trace import Trace, TraceRequest, save_trace  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
COMPRESSION = dict(block_size=16, window=4, kv_budget=32)

_COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=128, max_position_embeddings=256, bos_token_id=None,
               eos_token_id=None, pad_token_id=None)
CONFIGS = {
    "qwen3": lambda: transformers.Qwen3Config(**_COMMON, num_key_value_heads=2, head_dim=32,
                                              tie_word_embeddings=True),
    "qwen2": lambda: transformers.Qwen2Config(**_COMMON, num_key_value_heads=2,
                                              tie_word_embeddings=False),
    # one KV head: at TP=2 it is replicated and its query heads split across the ranks
    "llama": lambda: transformers.LlamaConfig(**_COMMON, num_key_value_heads=1,
                                              tie_word_embeddings=False),
}


# Module-wide: torch on one thread (tests/conftest.py, `one_cpu_thread`).
pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """Tiny random HF directories of each architecture (weights ~N(0, 0.1), norms ~1)."""
    directories = {}
    for name, make_config in CONFIGS.items():
        directory = tmp_path_factory.mktemp(f"tiny-{name}")
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(make_config(), dtype=torch.float32)
        with torch.no_grad():
            for parameter_name, parameter in model.named_parameters():
                if "norm" in parameter_name:
                    parameter.copy_(1 + 0.1 * torch.randn_like(parameter))
                else:
                    parameter.normal_(0.0, 0.1)
        model.save_pretrained(directory)
        directories[name] = directory
    return directories


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 256, (32,), generator=generator).tolist()
    return [shared + torch.randint(0, 256, (n,), generator=generator).tolist() for n in (3, 21)] \
        + [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (1, 40)]


def generate(model: str, tensor_parallel: int, **knobs):
    """Greedy tokens, and each rank's caches after the run (one entry for TP=1)."""
    llm = LLM(model, tensor_parallel=tensor_parallel, **knobs)
    try:
        outputs = llm.generate(prompts(), GREEDY, progress=False)
        runner = llm.engine.runner
        caches = (runner.gather_caches() if tensor_parallel > 1 else
                  [{"kv": runner.caches.kv, "query": runner.caches.query,
                    "score": runner.caches.score}])
        return [output.token_ids for output in outputs], caches, llm.last_run
    finally:
        llm.close()


def assert_shards_match(full: dict, shards: list[dict], layout_of) -> None:
    """Every rank's KV / score cache holds exactly its KV heads of the one-rank cache, and its
    query cache its query heads: same kept tokens, same scores, replicas identical."""
    # `kv_memory_gb` is per GPU, so a rank plans more blocks (and slots) than one GPU; without
    # memory pressure both runs use the same lowest-numbered ones.
    blocks = min(full["kv"].shape[2], shards[0]["kv"].shape[2])
    full = {name: _first(name, tensor, blocks) for name, tensor in full.items()}
    shards = [{name: _first(name, tensor, blocks) for name, tensor in shard.items()}
              for shard in shards]
    if full["query"] is not None:
        slots = min(full["query"].shape[1], shards[0]["query"].shape[1])
        full["query"] = full["query"][:, :slots]
        for shard in shards:
            shard["query"] = shard["query"][:, :slots]
    for rank, shard in enumerate(shards):
        layout = layout_of(rank)
        kv = layout.kv_heads
        torch.testing.assert_close(shard["kv"], full["kv"][..., kv.start:kv.stop, :],
                                   rtol=1e-4, atol=1e-5)
        if full["score"] is not None:
            torch.testing.assert_close(shard["score"], full["score"][..., kv.start:kv.stop],
                                       rtol=1e-4, atol=1e-6)
        if full["query"] is not None:
            q = layout.query_heads
            torch.testing.assert_close(shard["query"], full["query"][..., q.start:q.stop, :],
                                       rtol=1e-4, atol=1e-5)
    for first, second in zip(shards, shards[1:]):
        if layout_of(0).kv_replicas > 1:  # replicas of one KV head: bit-identical
            assert torch.equal(first["kv"], second["kv"])
            if first["score"] is not None:
                assert torch.equal(first["score"], second["score"])


# ---------------------------------------------------------------------- layout and weights


def test_valid_sizes_and_errors():
    assert valid_sizes(get_preset("smollm2-135m")) == [1, 3]  # MLP width 1536: not 9
    assert valid_sizes(get_preset("qwen3-32b")) == [1, 2, 4, 8, 16, 32, 64]  # > 8: replicas
    with pytest.raises(ConfigError, match=r"tensor_parallel: 2 ranks cannot split .*"
                                          r"--tensor-parallel 1, 3"):
        check_tensor_parallel(get_preset("smollm2-135m"), 2)
    with pytest.raises(ConfigError, match="tensor_parallel"):
        LLM("random:smollm2-135m", tensor_parallel=2, device="cpu")


def test_more_ranks_than_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="tensor_parallel: 2 ranks need 2 GPUs.*1 are visible"):
        rank_devices(torch.device("cuda"), 2)


def test_replicated_layout():
    shape = get_preset("smollm2-135m").scaled(intermediate_size=1152)  # 9 | MLP width
    layouts = [ShardLayout(shape, rank, 9) for rank in range(9)]
    assert [list(layout.kv_heads) for layout in layouts] == [[r // 3] for r in range(9)]
    assert [list(layout.query_heads) for layout in layouts] == [[r] for r in range(9)]
    assert layouts[0].replica_groups() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert ShardLayout(shape, 1, 3).replica_groups() == []


def test_streamed_random_weights_equal_the_loaders():
    """The sharded loader regenerates `initialise_random`'s weights tensor by tensor."""
    shape = get_preset("qwen3-0.6b").scaled(name="tiny", num_layers=2, hidden_size=32,
                                             num_heads=4, num_kv_heads=2, head_dim=8,
                                             intermediate_size=64, vocab_size=100)
    whole = build_model(shape, torch.float32, torch.device("cpu"))
    initialise_random(whole, 0)
    skeleton = build_model(shape, torch.float32, torch.device("meta"))
    streamed = dict(_random_full_tensors(skeleton, torch.float32, torch.device("cpu")))
    assert streamed.keys() == dict(whole.named_parameters()).keys()
    for name, parameter in whole.named_parameters():
        assert torch.equal(streamed[name], parameter), name
    assert any(isinstance(m, RMSNorm) for m in whole.modules())


def test_vocabulary_rows_pad_the_last_rank():
    assert ShardGroup(0, 3).vocab_rows(100) == (0, 34)
    assert ShardGroup(2, 3).vocab_rows(100) == (68, 34)


# ---------------------------------------------------------------------- compression kernel


def test_split_gqa_group_keeps_the_tokens_of_the_whole_group():
    """One KV head whose 4 query heads are split over 2 ranks: with the group max reduced
    across them, each rank keeps exactly the entries (and scores) the whole group keeps."""
    generator = torch.Generator().manual_seed(0)
    b, w, d, blocks = 8, 4, 16, 6
    params = CompressionParams(block_size=b, window=w)
    k = torch.randn(1, blocks, b, 1, d, generator=generator)
    v = torch.randn(1, blocks, b, 1, d, generator=generator)
    score = torch.rand(1, blocks, b, 1, generator=generator)
    query = torch.randn(1, 1, w, 4, d, generator=generator)
    tables = dict(source_tables=torch.tensor([[0, 1, 2, 3]]), num_source_blocks=torch.tensor([4]),
                  target_tables=torch.tensor([[4, 5]]), query_slots=torch.tensor([0]),
                  is_compressed=torch.tensor([True]))
    whole = [t.clone() for t in (k, v, score)]
    compress_ref(*whole, query, **tables, params=params, scale=d ** -0.5)

    # Pass 1 records each rank's local group max; pass 2 reduces with the other rank's.
    local_max: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    for rank in (0, 1):
        compress_ref(*[t.clone() for t in (k, v, score)], query[..., 2 * rank:2 * rank + 2, :],
                     **tables, params=params, scale=d ** -0.5,
                     reduce_group_max=lambda t, r=rank: local_max[r].append(t.clone()) or t)
    for rank in (0, 1):
        reduced = iter(torch.maximum(a, b) for a, b in zip(local_max[0], local_max[1]))
        shard = [t.clone() for t in (k, v, score)]
        compress_ref(*shard, query[..., 2 * rank:2 * rank + 2, :], **tables, params=params,
                     scale=d ** -0.5, reduce_group_max=lambda t: next(reduced))
        for ours, theirs in zip(shard, whole):
            assert torch.equal(ours, theirs)


# ---------------------------------------------------------------------- end to end (gloo)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_full_kv_tp2_equals_tp1(tiny_models, arch):
    model = str(tiny_models[arch])
    knobs = dict(compress=False, block_size=16, kv_memory_gb=0.002, dtype="float32",
                 device="cpu")
    expected, full, run = generate(model, 1, **knobs)
    tokens, shards, tp_run = generate(model, 2, **knobs)
    assert tokens == expected
    assert_shards_match(full[0], shards, lambda rank: ShardLayout(
        _shape(model), rank, 2))


@pytest.mark.parametrize("arch,asynchronous", [("llama", False), ("llama", True),
                                               ("qwen3", True)])
def test_compression_tp2_keeps_the_tokens_of_tp1(tiny_models, arch, asynchronous):
    model = str(tiny_models[arch])
    knobs = dict(COMPRESSION, async_compress=asynchronous, kv_memory_gb=0.001, dtype="float32",
                 device="cpu")
    expected, full, run = generate(model, 1, **knobs)
    tokens, shards, tp_run = generate(model, 2, **knobs)
    assert run.summary["compressions"] > 0
    assert tokens == expected
    assert tp_run.summary["compressions"] == run.summary["compressions"]
    assert run.summary["preemptions"] == tp_run.summary["preemptions"] == 0
    assert_shards_match(full[0], shards, lambda rank: ShardLayout(_shape(model), rank, 2))


@pytest.mark.parametrize("compress", [False, True])
def test_async_scheduling_tp2_keeps_the_tokens_of_tp1(tiny_models, compress):
    """Async scheduling over two ranks: rank 0 launches each step before the previous one's
    tokens are on its host, and broadcasts the sampled ids for the worker's decode rows, which
    the plan it sent could not carry. The synchronous one-rank tokens, compression (before the
    step's decode: deterministic) or Full KV; the same compressions, and the same caches."""
    model = str(tiny_models["qwen3"])
    knobs = dict(COMPRESSION if compress else dict(compress=False, block_size=16),
                 kv_memory_gb=0.001 if compress else 0.002, dtype="float32", device="cpu")
    if compress:
        knobs["async_compress"] = False
    expected, full, run = generate(model, 1, **knobs)
    tokens, shards, tp_run = generate(model, 2, async_scheduling=True, **knobs)
    assert tokens == expected
    assert tp_run.summary["compressions"] == run.summary["compressions"]
    assert not compress or run.summary["compressions"] > 0
    assert any(record.planned_early for record in tp_run.steps)  # the steps were launched early
    assert_shards_match(full[0], shards, lambda rank: ShardLayout(_shape(model), rank, 2))


def test_async_scheduling_tp2_with_samples_of_one_prompt(tiny_models):
    """Samples of one prompt (n = 2): a fork samples from its leader's logits in the step that
    admits it, a row rank 0 broadcasts beside the others; the one-rank synchronous tokens."""
    model = str(tiny_models["llama"])
    knobs = dict(compress=False, block_size=16, kv_memory_gb=0.002, dtype="float32", device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, n=2)
    found = {}
    for world, asynchronous in ((1, False), (2, True)):
        with LLM(model, tensor_parallel=world, async_scheduling=asynchronous, **knobs) as llm:
            outputs = llm.generate(prompts(), params, progress=False)
            found[world] = [[sample.token_ids for sample in output.outputs] for output in outputs]
            assert llm.last_run.summary["completed"] == 2 * len(prompts())
    assert found[2] == found[1]
    assert all(len(samples) == 2 for samples in found[1])


def test_warm_logits_runs_on_every_rank_and_changes_no_token(tiny_models):
    """The warm-up's LM-head pass under tensor parallelism (on a GPU, `warm_up` runs it): the
    logits gather is a collective, so every rank runs every row count in the same order; a run
    after it gives the one-rank tokens."""
    model = str(tiny_models["qwen3"])
    knobs = dict(compress=False, block_size=16, kv_memory_gb=0.002, dtype="float32", device="cpu",
                 max_num_seqs=8)
    expected, _, _ = generate(model, 1, **knobs)
    llm = LLM(model, tensor_parallel=2, **knobs)
    try:
        llm.engine.runner.warm_logits()
        outputs = llm.generate(prompts(), GREEDY, progress=False)
        assert [output.token_ids for output in outputs] == expected
    finally:
        llm.close()


def test_host_tier_tp2_equals_tp1(tiny_models):
    """A host tier under tensor parallelism: each rank saves and loads its own heads' share.
    One request at a time on a pool the middle one takes whole, so the third request's prefix
    comes back from host memory; TP=2 plans per rank at half the bytes, so both runs have the
    same blocks and slots, make the same copies and give the same tokens."""
    from zipage.core.memory import block_bytes

    model = str(tiny_models["qwen3"])
    config = ZipageConfig(compress=False, block_size=16)
    per_block = block_bytes(_shape(model), config, 4) / 2**30  # float32, one rank
    generator = torch.Generator().manual_seed(11)
    shared, other, tail = (torch.randint(0, 256, (n,), generator=generator).tolist()
                           for n in (50, 70, 9))
    prompts_ = [shared, other, shared + tail]
    runs = []
    for world in (1, 2):
        llm = LLM(model, tensor_parallel=world, compress=False, block_size=16, max_num_seqs=1,
                  kv_memory_gb=6.5 * per_block / world, host_kv_gb=8.5 * per_block / world,
                  dtype="float32", device="cpu")
        try:
            outputs = llm.generate(prompts_, GREEDY, progress=False)
            capacity = llm.engine.capacity
            runs.append(([output.token_ids for output in outputs],
                         llm.last_run.summary | {"num_blocks": capacity.num_blocks}))
        finally:
            llm.close()
    (tokens, summary), (tp_tokens, tp_summary) = runs
    assert summary["num_blocks"] == tp_summary["num_blocks"] == 6
    assert summary["host_hit_tokens"] == tp_summary["host_hit_tokens"] > 0
    assert tp_tokens == tokens


def test_smollm2_random_tp3_equals_tp1():
    """SmolLM2's 9 query / 3 KV heads at TP=3 (gloo, three processes), random weights."""
    knobs = dict(compress=False, block_size=16, kv_memory_gb=0.01, dtype="float32", device="cpu",
                 max_model_len=128)
    short = [[1, 2, 3], list(range(100, 120))]
    results = []
    for world in (1, 3):
        llm = LLM("random:smollm2-135m", tensor_parallel=world, **knobs)
        try:
            outputs = llm.generate(short, SamplingParams(temperature=0.0, max_tokens=4,
                                                         ignore_eos=True), progress=False)
            results.append([output.token_ids for output in outputs])
        finally:
            llm.close()
    assert results[0] == results[1]


def test_engine_tp2_makes_the_simulators_decisions(tiny_models, tmp_path):
    requests = [TraceRequest(id=f"r{i}", arrival_s=0.0, prompt_len=length, output_len=output)
                for i, (length, output) in enumerate([(20, 40), (33, 24), (5, 50), (40, 30)])]
    trace_path = tmp_path / "trace.json"
    save_trace(Trace("tp-vs-sim", requests), trace_path)
    common = ["replay", str(trace_path), "--model", str(tiny_models["qwen3"]), "--block-size",
              "16", "--window", "4", "--budget", "32", "--no-async", "--dtype", "float32",
              "--kv-memory-gb", "0.0003", "--tensor-parallel", "2", "--json"]
    runs = {}
    for name, extra in (("sim", []), ("cpu", ["--engine", "cpu"])):
        result = subprocess.run([sys.executable, "-m", "zipage.cli", *common, *extra, "--out",
                                 str(tmp_path / name)], capture_output=True, text=True, cwd=ROOT,
                                timeout=120)
        assert result.returncode == 0, result.stderr
        runs[name] = json.loads(result.stdout)
    assert runs["cpu"]["compressions"] > 0
    assert runs["sim"]["num_blocks"] == runs["cpu"]["num_blocks"]
    assert read_decisions(tmp_path / "sim") == read_decisions(tmp_path / "cpu")


@pytest.mark.parametrize("action,message", [("raise", "rank 1 failed: RuntimeError: injected"),
                                            ("exit", "rank 1 exited with code 7")])
def test_a_failing_rank_stops_the_run_naming_it(tiny_models, monkeypatch, action, message):
    """Rank 1 runs tests/tp_failing_worker.py, the worker with its step 3 failing."""
    from zipage.engine import parallel

    worker_command = parallel.worker_command
    monkeypatch.setattr(parallel, "worker_command", lambda rank: (
        [sys.executable, str(ROOT / "tests" / "tp_failing_worker.py"), "3", action]
        if rank == 1 else worker_command(rank)))
    llm = LLM(str(tiny_models["qwen3"]), tensor_parallel=2, compress=False, block_size=16,
              kv_memory_gb=0.002, device="cpu")
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match=message):
        llm.generate(prompts(), GREEDY, progress=False)
    assert time.monotonic() - started < 30
    with pytest.raises(TensorParallelError, match="shut down"):
        llm.generate(prompts(), GREEDY, progress=False)
    assert all(worker.process.poll() is not None for worker in llm.engine.runner.links.workers)


def _first(name: str, tensor, blocks: int):
    if tensor is None or name == "query":
        return tensor
    return tensor[:, :, :blocks] if name == "kv" else tensor[:, :blocks]


def _shape(model: str):
    from zipage.model_spec import resolve_shape

    return resolve_shape(model)


def test_replay_and_llm_close_their_ranks(tiny_models):
    """The engine leaves its process group when the run ends, not when the garbage collector
    gets to it (an NCCL teardown at interpreter exit can wait forever on a peer)."""
    import torch.distributed as dist

    settings = ReplaySettings(model=str(tiny_models["qwen3"]), dtype="float32",
                              kv_memory_gb=0.002, tensor_parallel=2,
                              config=ZipageConfig(block_size=16, window=4, kv_budget=32))
    trace = Trace("close", [TraceRequest(id="a", arrival_s=0.0, prompt_len=12, output_len=6)])
    summary, _ = replay_on_engine(trace, settings, "cpu")
    assert summary["completed"] == 1 and not dist.is_initialized()
    with LLM(str(tiny_models["qwen3"]), tensor_parallel=2, compress=False, block_size=16,
             kv_memory_gb=0.002, device="cpu") as llm:
        workers = llm.engine.runner.links.workers
        assert llm.generate([[1, 2, 3]], GREEDY, progress=False)[0].token_ids
    assert not dist.is_initialized()
    assert all(worker.process.poll() is not None for worker in workers)
