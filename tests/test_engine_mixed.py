"""Mixed steps (chunked prefill) in the engine: hand-built plans that split a prompt into chunks,
interleaved with other requests' decodes, against the unchunked run of the same requests.

Both runs drive one `ModelRunner` each (CPU, float32, reference kernels) through the same block
tables and query slots; the greedy tokens must be identical, and so must every KV entry and every
window query the requests own. The plans are what the core's chunked scheduler emits (a PREFILL
plan that may hold partial chunks, MIXED plans with decodes and chunks), built by hand so that
chunk ends land where they matter: inside a block, on a block boundary, inside the window of the
final prompt block, and a step whose chunks are all partial (nothing is sampled).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from smollm2 import GGUF, SKIP_REASON  # noqa: E402
from test_models_hf_parity import _hf_greedy, _tiny_hf_model  # noqa: E402
from triton_interpreter import TRITON_INSTALLED, UNDER_INTERPRETER, run_test_file_under_interpreter, under_interpreter  # noqa: E402

from zipage.config import ZipageConfig  # noqa: E402
from zipage.core.memory import MemoryPlan  # noqa: E402
from zipage.core.sampling import SamplingParams  # noqa: E402
from zipage.core.sequence import Sequence  # noqa: E402
from zipage.core.step import DECODE, MIXED, PREFILL, PrefillItem, StepPlan  # noqa: E402
from zipage.core.window import WindowLayout  # noqa: E402
from zipage.engine import loader  # noqa: E402
from zipage.engine import runner as runner_module  # noqa: E402
from zipage.engine.parallel import decode_step, encode_step  # noqa: E402
from zipage.engine.runner import ModelRunner  # noqa: E402
from zipage.rundir import read_decisions  # noqa: E402

BLOCK_SIZE, WINDOW = 16, 4
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
# The CPU tests run in the parent only: in the TRITON_INTERPRET=1 child every kernel of theirs
# would be interpreted (the child runs the `under_interpreter` tests).
on_the_cpu = pytest.mark.skipif(UNDER_INTERPRETER, reason="a CPU-reference test; the child runs Triton's")

# Prompt lengths. "a" (62 tokens: its final block is [48, 64), window entries 60..63) is chunked
# at 7 (inside block 0), 16 (a block boundary), 37 (inside block 2), 61 (inside the final block's
# window), 62; "d" at 10 and 32 (a boundary) while the others decode. "a", "b" and "d" end inside
# their final block's window, so their prefills write window queries.
PROMPT_LENGTHS = {"a": 62, "b": 30, "c": 5, "d": 46}
# One step per entry: (chunks as {request: end of the range}, decoding requests). The unchunked
# run prefills everything in one step; both then decode until every request has NEW_TOKENS.
CHUNKED_SCHEDULE = [
    ({"d": 10}, []),  # a PREFILL plan of one partial chunk: nothing samples
    ({"b": 30, "c": 5, "a": 7}, []),  # whole prompts and a partial chunk in one PREFILL plan
    ({"a": 16, "d": 32}, ["b", "c"]),
    ({"a": 37, "d": 46}, ["b", "c"]),
    ({"a": 61}, ["b", "c", "d"]),
    ({"a": 62}, ["c", "d", "b"]),  # decode order is the plan's, not admission order
]


# Module-wide: torch on one thread (tests/conftest.py, `one_cpu_thread`).
pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@dataclass
class Driver:
    """Executes hand-built plans on a runner and keeps each request's counters as the core would."""

    runner: ModelRunner
    prompts: dict[str, list[int]]
    sequences: dict[str, Sequence] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    # The window queries each prefill wrote, read right after the step that completed the prompt
    # (later decodes of a new final block overwrite the slot's rows).
    prompt_queries: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Fixed, shuffled block tables and one query slot per request: both runs use the same.
        order = torch.randperm(self.runner.caches.kv.shape[2],
                               generator=torch.Generator().manual_seed(5)).tolist()
        blocks_each = -(-(max(map(len, self.prompts.values())) + NEW_TOKENS) // BLOCK_SIZE)
        for slot, (seq_id, prompt) in enumerate(self.prompts.items()):
            seq = Sequence(seq_id, prompt, NEW_TOKENS, sampling=GREEDY)
            seq.block_table = order[slot * blocks_each:(slot + 1) * blocks_each]
            seq.query_slot = slot
            self.sequences[seq_id] = seq
            self.tokens[seq_id] = list(prompt)

    def step(self, chunks: dict[str, int], decoding: list[str]) -> None:
        items = []
        for seq_id, end in chunks.items():
            seq = self.sequences[seq_id]
            items.append(PrefillItem(seq, seq.kv_len, end, samples=end == seq.num_tokens))
        decode = [self.sequences[seq_id] for seq_id in decoding]
        kind = MIXED if items and decode else PREFILL if items else DECODE
        plan = StepPlan(step_id=0, kind=kind, prefill=items, decode=decode)
        sampled = self.runner.execute(plan, self.tokens)
        assert [seq for seq, _ in sampled] == plan.sampled
        for seq, token in sampled:
            self.tokens[seq.seq_id].append(token)
        for item in items:
            outputs = item.seq.num_output_tokens + (1 if item.samples else 0)
            item.seq.set_counters(item.num_tokens, outputs)
            if item.samples:
                self.prompt_queries[item.seq.seq_id] = self.window_queries(item.seq)
        for seq in decode:
            seq.set_counters(seq.kv_len + 1, seq.num_output_tokens + 1)

    def decode_to_the_end(self) -> None:
        while True:
            decoding = [seq_id for seq_id, seq in self.sequences.items()
                        if seq.num_output_tokens < NEW_TOKENS]
            if not decoding:
                return
            self.step({}, decoding)

    def window_queries(self, seq: Sequence) -> torch.Tensor:
        """The query-cache rows of the computed window entries of `seq`'s current final block
        [layers, rows, heads, dim]: what a compression of it would read."""
        layout = WindowLayout(BLOCK_SIZE, WINDOW)
        first, last = layout.query_range(seq.query_slot, 0, seq.kv_len)
        rows = layout.row(seq.query_slot, torch.arange(first, last))
        return self.runner.caches.query.flatten(1, 2)[:, rows].clone()

    def outputs(self) -> dict[str, list[int]]:
        return {seq_id: tokens[len(self.prompts[seq_id]):] for seq_id, tokens in self.tokens.items()}


def make_runner(model, shape, max_num_batched_tokens: int = 16384, **runner_options) -> ModelRunner:
    config = ZipageConfig(block_size=BLOCK_SIZE, window=WINDOW, kv_budget=2 * BLOCK_SIZE,
                          max_num_batched_tokens=max_num_batched_tokens)
    capacity = MemoryPlan(num_blocks=48, num_query_slots=len(PROMPT_LENGTHS), block_bytes=0,
                          query_slot_bytes=0, available_bytes=0)
    return ModelRunner(model, shape, config, capacity, torch.float32, torch.device("cpu"),
                       **runner_options)


def run_unchunked(model, shape, prompts) -> Driver:
    driver = Driver(make_runner(model, shape, prefill_graphs=False), prompts)
    driver.step({seq_id: len(prompt) for seq_id, prompt in prompts.items()}, [])
    driver.decode_to_the_end()
    return driver


def run_chunked(model, shape, prompts, schedule=CHUNKED_SCHEDULE, **runner_options) -> Driver:
    runner_options.setdefault("prefill_graphs", False)
    driver = Driver(make_runner(model, shape, **runner_options), prompts)
    for chunks, decoding in schedule:
        driver.step(chunks, decoding)
    driver.decode_to_the_end()
    return driver


def owned_entries(driver: Driver) -> dict[str, list[torch.Tensor]]:
    """Per request: its cached K/V entries [2, layers, kv_len, heads, dim], the window queries its
    prefill wrote and those of its final block at the end."""
    owned = {}
    for seq_id, seq in driver.sequences.items():
        entries = torch.arange(seq.kv_len)
        blocks = torch.tensor(seq.block_table)[entries // BLOCK_SIZE]
        kv = driver.runner.caches.kv[:, :, blocks, entries % BLOCK_SIZE]
        owned[seq_id] = [kv, driver.prompt_queries[seq_id], driver.window_queries(seq)]
    return owned


# Not bit-exact: the CPU's BLAS picks its kernel by matrix shape (a matmul of 1-3 rows rounds
# differently from the same rows inside a larger one, ~4e-6 here), so a token computed in another
# batch differs in the last bits, as between two decode batch sizes of the unchunked engine. A
# wrong position, a missing or extra key, or a misplaced entry moves values by 1e-2 and more.
CACHE_TOLERANCE = dict(atol=2e-5, rtol=2e-5)


def assert_same_caches(chunked: Driver, unchunked: Driver, tolerance: dict = CACHE_TOLERANCE) -> None:
    expected = owned_entries(unchunked)
    for seq_id, tensors in owned_entries(chunked).items():
        for tensor, reference in zip(tensors, expected[seq_id]):
            torch.testing.assert_close(tensor, reference, **tolerance, msg=seq_id)
    written = {seq_id for seq_id, queries in chunked.prompt_queries.items() if queries.shape[1]}
    assert written == {"a", "b", "d"}  # the comparison covered the chunk-written windows


def random_prompts(vocab_size: int, seed: int = 2) -> dict[str, list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return {seq_id: torch.randint(0, vocab_size, (length,), generator=generator).tolist()
            for seq_id, length in PROMPT_LENGTHS.items()}


@on_the_cpu
@pytest.mark.parametrize("architecture", ["qwen3", "qwen2", "llama"])
def test_chunked_prefill_equals_unchunked_on_tiny_models(architecture: str, tmp_path: Path) -> None:
    hf_model = _tiny_hf_model(architecture, tmp_path)
    model, shape, _ = loader.load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    prompts = random_prompts(shape.vocab_size)
    unchunked = run_unchunked(model, shape, prompts)
    chunked = run_chunked(model, shape, prompts)
    assert chunked.outputs() == unchunked.outputs()
    assert_same_caches(chunked, unchunked)
    # and both are HF's greedy continuation
    expected = _hf_greedy(hf_model, list(prompts.values()), NEW_TOKENS)
    assert list(unchunked.outputs().values()) == expected


@on_the_cpu
def test_chunked_prefill_equals_unchunked_on_smollm2() -> None:
    gguf_path = GGUF
    if gguf_path is None:
        pytest.skip(SKIP_REASON)
    model, shape, tokenizer = loader.load_model(str(gguf_path), dtype=torch.float32, device="cpu")
    text = ("The history of the city begins in the Roman era, when a small settlement grew along "
            "the river where two trade roads met. By the middle ages it had become a busy market "
            "town with a cathedral, a bridge of stone and walls that enclosed the old quarter. In "
            "the nineteenth century the railway arrived, factories rose along the canal, and the")
    ids = tokenizer(text).input_ids
    assert len(ids) >= PROMPT_LENGTHS["a"]
    prompts = {seq_id: ids[:length] for seq_id, length in PROMPT_LENGTHS.items()}
    unchunked = run_unchunked(model, shape, prompts)
    chunked = run_chunked(model, shape, prompts)
    assert chunked.outputs() == unchunked.outputs()
    assert_same_caches(chunked, unchunked)


@on_the_cpu
def test_a_step_of_partial_chunks_samples_nothing(tmp_path: Path) -> None:
    _tiny_hf_model("qwen3", tmp_path)
    model, shape, _ = loader.load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    driver = Driver(make_runner(model, shape), random_prompts(shape.vocab_size))
    seq = driver.sequences["a"]
    plan = StepPlan(step_id=0, kind=PREFILL, prefill=[PrefillItem(seq, 0, 20, samples=False)])
    assert driver.runner.execute(plan, driver.tokens) == []
    assert driver.runner.last_logits is None


@on_the_cpu
def test_a_worker_rank_lays_out_mixed_steps_as_rank_0(tmp_path: Path) -> None:
    """Tensor parallelism sends each plan to the workers as plain data (`encode_step`); a worker's
    forward of the decoded plan must be rank 0's: same kind, chunks with their `samples`, decodes,
    and so the same logits and caches."""
    _tiny_hf_model("qwen2", tmp_path)
    model, shape, _ = loader.load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    worker_model, _, _ = loader.load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    prompts = random_prompts(shape.vocab_size)
    # Two models: a runner points its model's attention layers at its own caches.
    rank0, worker = Driver(make_runner(model, shape), prompts), make_runner(worker_model, shape)
    for chunks, decoding in CHUNKED_SCHEDULE[:4]:
        plan_items = [PrefillItem(rank0.sequences[s], rank0.sequences[s].kv_len, end,
                                  end == rank0.sequences[s].num_tokens) for s, end in chunks.items()]
        plan = StepPlan(step_id=0, kind=MIXED if decoding else PREFILL, prefill=plan_items,
                        decode=[rank0.sequences[s] for s in decoding])
        worker_plan, worker_tokens, _ = decode_step(encode_step(plan, rank0.tokens, []))
        assert worker_plan.kind == plan.kind
        assert [(i.num_cached_tokens, i.num_tokens, i.samples) for i in worker_plan.prefill] == [
            (i.num_cached_tokens, i.num_tokens, i.samples) for i in plan.prefill]
        worker.forward(worker_plan, worker_tokens)
        rank0.step(chunks, decoding)
        if plan.sampled:
            assert torch.equal(worker.last_logits, rank0.runner.last_logits)
        else:
            assert worker.last_logits is None is rank0.runner.last_logits
    assert torch.equal(worker.caches.kv, rank0.runner.caches.kv)
    assert torch.equal(worker.caches.query, rank0.runner.caches.query)


@pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")
@pytest.mark.skipif(UNDER_INTERPRETER, reason="this is the child process already")
def test_triton_mixed_steps_under_the_interpreter() -> None:
    run_test_file_under_interpreter(__file__)


@under_interpreter
def test_triton_mixed_steps_equal_unchunked(tmp_path: Path, monkeypatch) -> None:
    """The same chunked schedule through the Triton kernels (interpreted, float32): mixed steps
    run the prefill kernel on the chunk rows and the split-K decode kernel on the decode rows."""
    _tiny_hf_model("qwen3", tmp_path)
    model, shape, _ = loader.load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    prompts = random_prompts(shape.vocab_size)
    unchunked = run_unchunked(model, shape, prompts)
    chunked = run_chunked(model, shape, prompts)
    assert chunked.outputs() == unchunked.outputs()
    assert_same_caches(chunked, unchunked, dict(atol=1e-4, rtol=1e-4))
    # The padded layout of prefill graphs (tests/test_engine_prefill_graphs.py): one prefill launch
    # over a padded work list, decode rows as 1-token sequences, padding rows left unwritten.
    padded = run_chunked(model, shape, prompts, prefill_graphs=True)
    assert padded.outputs() == unchunked.outputs()
    assert_same_caches(padded, unchunked, dict(atol=1e-4, rtol=1e-4))
    # The decode section (the tiny contexts are below its rule's threshold, so forced here): the
    # decode rows leave the prefill launch for the split-K kernel, put back by row index.
    monkeypatch.setattr(runner_module, "takes_decode_section",
                        lambda bucket, num_decode, longest: 0 < num_decode <= bucket - 1)
    sectioned = run_chunked(model, shape, prompts, prefill_graphs=True)
    assert sectioned.outputs() == unchunked.outputs()
    assert_same_caches(sectioned, unchunked, dict(atol=1e-4, rtol=1e-4))


# ---------------------------------------------------------------- through the core's chunked scheduler

from test_engine import GREEDY as ENGINE_GREEDY  # noqa: E402,F401
from test_engine import (  # noqa: E402
    prompts_with_shared_prefix,
    replay_sim_and_cpu,
    tiny_model,  # noqa: E402,F401  (a fixture the tests below take)
)
from test_engine_compression import SMALL  # noqa: E402

from zipage import LLM  # noqa: E402

CHUNKED = dict(chunked_prefill=True, max_num_batched_tokens=24)


@on_the_cpu
@pytest.mark.parametrize("knobs", [dict(compress=False, block_size=16, kv_memory_gb=0.002),
                                   dict(SMALL, async_compress=False), SMALL],
                         ids=["full-kv", "compress-sync", "compress-async"])
@pytest.mark.parametrize("prefill_graphs", [False, True], ids=["eager", "padded"])
def test_chunked_engine_runs_equal_unchunked(tiny_model, knobs, prefill_graphs):  # noqa: F811
    """`LLM.generate` with the core's chunked prefill (24-token steps: prompts of 41-60 tokens in
    chunks, mixed steps, prefix hits, preemption under the small caches, compression) gives the
    unchunked run's tokens, eagerly and through the padded layout of prefill graphs."""
    directory, _ = tiny_model
    prompts = prompts_with_shared_prefix()
    expected = LLM(str(directory), **knobs).generate(prompts, ENGINE_GREEDY, progress=False)
    llm = LLM(str(directory), **knobs, **CHUNKED, prefill_graphs=prefill_graphs)
    assert bool(llm.engine.runner.prefill_buckets) == prefill_graphs
    outputs = llm.generate(prompts, ENGINE_GREEDY, progress=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    kinds = {step.kind for step in llm.last_run.steps}
    assert "mixed" in kinds
    assert max(step.prefill_tokens for step in llm.last_run.steps) <= 24
    if knobs.get("compress", True):
        assert llm.last_run.summary["compressions"] > 0


@on_the_cpu
def test_chunked_engine_makes_the_simulators_decisions(tiny_model, tmp_path):  # noqa: F811
    """`zipage replay --chunked-prefill` on the CPU engine and in the simulator: the same decision
    log step for step (mixed steps, partial chunks, preemptions), so the engine loop hands the
    core exactly what the simulator does."""
    directory, _ = tiny_model
    runs = replay_sim_and_cpu(directory, tmp_path, "chunked-engine-vs-sim",
                              [(20, 30), (53, 12), (5, 50), (40, 8), (17, 25), (64, 3)],
                              "--chunked-prefill", "--max-num-batched-tokens", "24")
    logs = {}
    for name, summary in runs.items():
        assert summary["preemptions"] > 0
        logs[name] = "\n".join(read_decisions(tmp_path / name))
    assert " mixed " in logs["cpu"] and "+" in logs["cpu"]  # mixed steps and partial chunks
    assert logs["sim"] == logs["cpu"]
