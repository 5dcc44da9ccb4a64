"""Padded prefill / mixed steps, the layout CUDA graphs of prefill steps replay (CPU side).

A graph cannot be captured here, but everything it runs can: with prefill graphs on, a step of
up to the largest token bucket is staged into the runner's static tensors in the padded layout
(rows padded to the bucket, sequences to the bucket's capacity, decode rows as 1-token sequences
folded into a fixed-size work list or, a few rows of long context, in the decode section's
slots) and the padded forward runs on them, exactly the forward a graph captures. It must give
the eager results; the Triton side (padded work items, the section) is checked under the
interpreter in tests/test_kernels_attention.py and tests/test_engine_mixed.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_engine import GREEDY, hf_greedy, prompts_with_shared_prefix, tiny_model  # noqa: E402,F401
from test_engine_compression import SMALL  # noqa: E402
from test_engine_mixed import assert_same_caches, random_prompts, run_chunked, run_unchunked  # noqa: E402
from test_models_hf_parity import _tiny_hf_model  # noqa: E402

from zipage import LLM  # noqa: E402
from zipage.engine import loader  # noqa: E402
from zipage.engine import runner as runner_module  # noqa: E402
from zipage.engine.runner import ModelRunner  # noqa: E402
from zipage.rundir import read_decisions  # noqa: E402

# Module-wide: torch on one thread (tests/conftest.py, `one_cpu_thread`).
pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def count_padded_steps(monkeypatch) -> list[int]:
    """Record the bucket of every padded forward the runners of this test run."""
    buckets: list[int] = []
    original = ModelRunner.padded_forward

    def spy(runner, bucket, sectioned):
        buckets.append(bucket)
        return original(runner, bucket, sectioned)

    monkeypatch.setattr(ModelRunner, "padded_forward", spy)
    return buckets


@pytest.mark.parametrize("architecture", ["qwen3", "llama"])
def test_padded_mixed_steps_equal_eager(architecture: str, tmp_path: Path, monkeypatch) -> None:
    _tiny_hf_model(architecture, tmp_path)
    model, shape, _ = loader.load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    prompts = random_prompts(shape.vocab_size)
    buckets = count_padded_steps(monkeypatch)
    unchunked = run_unchunked(model, shape, prompts)
    assert not buckets  # graphs off: the eager path
    padded = run_chunked(model, shape, prompts, prefill_graphs=True)
    assert padded.outputs() == unchunked.outputs()
    assert_same_caches(padded, unchunked)
    # every prefill and mixed step of the schedule was padded (decode steps use decode graphs)
    assert buckets == [16, 64, 64, 64, 32, 16]  # 10, 42, 33, 37, 27 and 4 rows


def record_layouts(monkeypatch) -> list[tuple]:
    """Record (inputs, layout) of every padded step the runners of this test stage."""
    layouts: list[tuple] = []
    original = ModelRunner.padded_layout

    def spy(runner, inputs, bucket):
        layout = original(runner, inputs, bucket)
        layouts.append((inputs, layout))
        return layout

    monkeypatch.setattr(ModelRunner, "padded_layout", spy)
    return layouts


# The decode section's rule, forced either way: the tiny models' contexts are far below the
# engine's DECODE_SECTION_MIN_CONTEXT, so by the rule itself every mixed step here folds.
SECTION_RULES = {"never": lambda bucket, num_decode, longest: False,
                 "always": lambda bucket, num_decode, longest: 0 < num_decode <= bucket - 1,
                 # both graphs of a bucket in one run, the section's slots refilled after steps
                 # that left them stale
                 "odd": lambda bucket, num_decode, longest: 0 < num_decode <= bucket - 1 and num_decode % 2 == 1}


def force_decode_section(monkeypatch, rule: str) -> None:
    monkeypatch.setattr(runner_module, "takes_decode_section", SECTION_RULES[rule])


@pytest.mark.parametrize("rule", ["never", "always"])
def test_padded_mixed_steps_with_or_without_the_decode_section_equal_eager(rule: str, tmp_path: Path,
                                                                           monkeypatch) -> None:
    """With the decode section a mixed step's decode rows fill its slots and leave the prefill
    work list; without it each is a work item. Both give the eager results."""
    _tiny_hf_model("qwen3", tmp_path)
    model, shape, _ = loader.load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    prompts = random_prompts(shape.vocab_size)
    unchunked = run_unchunked(model, shape, prompts)
    force_decode_section(monkeypatch, rule)
    layouts = record_layouts(monkeypatch)
    padded = run_chunked(model, shape, prompts, prefill_graphs=True)
    assert padded.outputs() == unchunked.outputs()
    assert_same_caches(padded, unchunked)
    mixed = [(inputs, layout, sectioned) for inputs, (layout, sectioned) in layouts
             if inputs.decode_context_lens is not None]
    assert mixed and all(sectioned == (rule == "always") for _, _, sectioned in mixed)
    for inputs, layout, sectioned in mixed:
        chunks, decodes = len(inputs.context_lens), len(inputs.decode_context_lens)
        worked = set(layout["work_items"][:, 0].tolist()) - {-1}
        assert worked == set(range(chunks + (0 if sectioned else decodes)))
        if not sectioned:
            assert "section_rows" not in layout
            continue
        first_decode_row = int(inputs.cu_seqlens_q[-1])
        filled = layout["section_filled"].flatten()
        assert filled.tolist() == [True] * decodes + [False] * (len(filled) - decodes)
        assert layout["section_rows"][:decodes].tolist() == list(range(first_decode_row, first_decode_row + decodes))
        assert not layout["section_rows"][decodes:].any()  # empty slots name row 0
        assert torch.equal(layout["section_context_lens"][:decodes], inputs.decode_context_lens)
        assert not layout["section_context_lens"][decodes:].any()


def test_the_decode_section_rule() -> None:
    """A step takes the section with at most its slots of decode rows, the longest long enough."""
    from zipage.prefill_buckets import DECODE_SECTION_MIN_CONTEXT, DECODE_SECTION_ROWS, takes_decode_section

    long = DECODE_SECTION_MIN_CONTEXT
    assert takes_decode_section(2048, DECODE_SECTION_ROWS, long)
    assert not takes_decode_section(2048, DECODE_SECTION_ROWS + 1, long)  # more rows fill the GPU
    assert not takes_decode_section(2048, 16, long - 1)  # a short tail the chunks' tiles hide
    assert not takes_decode_section(2048, 0, 0)
    assert takes_decode_section(16, 15, long) and not takes_decode_section(16, 16, long)


def test_steps_above_the_largest_bucket_run_eagerly(tmp_path: Path, monkeypatch) -> None:
    _tiny_hf_model("qwen3", tmp_path)
    model, shape, _ = loader.load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    prompts = random_prompts(shape.vocab_size)
    buckets = count_padded_steps(monkeypatch)
    unchunked = run_unchunked(model, shape, prompts)
    # buckets 16 and 32 only: the 42-, 33- and 37-row steps run eagerly, in the same run
    padded = run_chunked(model, shape, prompts, prefill_graphs=True, max_num_batched_tokens=32)
    assert padded.runner.prefill_buckets == (16, 32)
    assert buckets == [16, 32, 16]
    assert padded.outputs() == unchunked.outputs()
    assert_same_caches(padded, unchunked)


class EagerReplay:
    """Stands in for a captured prefill graph: the padded forward into the static hidden states."""

    def __init__(self, runner: ModelRunner, bucket: int, sectioned: bool) -> None:
        self.runner, self.bucket, self.sectioned = runner, bucket, sectioned

    def replay(self) -> None:
        self.runner.padded_inputs["hidden"][:self.bucket] = self.runner.padded_forward(self.bucket, self.sectioned)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prompts", "chunked"])
@pytest.mark.parametrize("knobs", [dict(compress=False, block_size=16, kv_memory_gb=0.002),
                                   dict(SMALL, async_compress=False), SMALL],
                         ids=["full-kv", "compress-sync", "compress-async"])
def test_graph_replay_path_matches_eager(tiny_model, knobs, chunked, monkeypatch):  # noqa: F811
    """Whole runs through the scheduler (prefix-cache hits, preemption, compression reading the
    window queries padded prefills wrote), the replay branch served by a stand-in graph: the
    static inputs are refilled step after step, with fewer sequences and narrower tables than
    earlier steps left behind. Chunked, the mixed steps switch between a bucket's two graphs."""
    if chunked:
        knobs = dict(knobs, chunked_prefill=True, max_num_batched_tokens=16)
    directory, reference = tiny_model
    prompts = prompts_with_shared_prefix()
    eager = LLM(str(directory), **knobs).generate(prompts, GREEDY, progress=False)
    llm = LLM(str(directory), **knobs, prefill_graphs=True)
    runner = llm.engine.runner
    assert runner.prefill_buckets and not runner.prefill_graphs  # on, nothing captured on the CPU
    runner.prefill_graphs = {(bucket, sectioned): EagerReplay(runner, bucket, sectioned)
                             for bucket in runner.prefill_buckets for sectioned in (False, True)}
    force_decode_section(monkeypatch, "odd")
    buckets, layouts = count_padded_steps(monkeypatch), record_layouts(monkeypatch)
    padded = llm.generate(prompts, GREEDY, progress=False)
    assert [o.token_ids for o in padded] == [o.token_ids for o in eager]
    mixed = {sectioned for inputs, (_, sectioned) in layouts if inputs.decode_context_lens is not None}
    assert mixed == ({False, True} if chunked else set())
    assert len(buckets) >= sum(1 for step in llm.last_run.steps if step.kind == "prefill") > 0
    if knobs.get("compress", True):
        assert llm.last_run.summary["compressions"] > 0
    else:
        assert [o.token_ids for o in padded] == hf_greedy(reference, prompts, len(padded[0].token_ids))


def test_replay_with_prefill_graphs(tiny_model, tmp_path, monkeypatch):  # noqa: F811
    """`replay_on_engine(..., prefill_graphs=True)` runs prefill and mixed steps through the
    padded layout and records what it replayed from graphs (nothing, on the CPU); the CLI flag
    gives a run that makes the simulator's decisions, step for step."""
    from test_engine import replay_sim_and_cpu

    from zipage.config import ZipageConfig
    from zipage.core.deployment import ReplaySettings
    from zipage.engine.replay import replay_on_engine
    from zipage.workloads import make_trace

    directory, _ = tiny_model
    buckets = count_padded_steps(monkeypatch)
    trace = make_trace("amc23", 0, num_questions=2, samples_per_question=2, max_output_len=20)
    settings = ReplaySettings(model=str(directory), dtype="float32", kv_memory_gb=0.002,
                              config=ZipageConfig(compress=False, block_size=16))
    summary, _ = replay_on_engine(trace, settings, "cpu", prefill_graphs=True)
    assert summary["completed"] == 4 and buckets
    assert summary["graphs"] == {"decode": False, "prefill": False}

    runs = replay_sim_and_cpu(directory, tmp_path, "padded-vs-sim",
                              [(20, 30), (53, 12), (5, 50), (40, 8)],
                              "--chunked-prefill", "--max-num-batched-tokens", "24",
                              "--prefill-graphs")
    assert runs["cpu"]["graphs"] == {"decode": False, "prefill": False}
    assert runs["sim"]["graphs"] is None  # the analytic model times no engine path
    logs = ["\n".join(read_decisions(tmp_path / name)) for name in ("sim", "cpu")]
    assert " mixed " in logs[1] and logs[0] == logs[1]
