"""The engine's warm-up runs each kind of step on scratch blocks and changes no later result."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_models import save_tiny_qwen3  # noqa: E402

from zipage import LLM, SamplingParams  # noqa: E402
from zipage.engine.warmup import warm_up  # noqa: E402


@pytest.mark.parametrize("compress,world,asynchronous", [(False, 1, False), (True, 1, False),
                                                          (True, 2, False), (True, 1, True)])
def test_warm_up_leaves_generation_unchanged(tmp_path, compress, world, asynchronous):
    """world 2: through the tensor-parallel executor (gloo), as `build_engine` warms a TP engine
    on a GPU: every rank runs the warm-up's steps and compression. Async scheduling: the steps
    are launched, the decode's token fed from the prefill's on the device."""
    torch.set_num_threads(1)
    save_tiny_qwen3(tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    prompts = [list(range(3, 40)), list(range(50, 70))]
    knobs = dict(block_size=16, window=4, kv_budget=32, kv_memory_gb=0.001, compress=compress,
                 async_scheduling=asynchronous)
    with LLM(str(tmp_path), **knobs) as cold:
        expected = [output.token_ids for output in cold.generate(prompts, params, progress=False)]
    warm = LLM(str(tmp_path), tensor_parallel=world, dtype="float32", device="cpu", **knobs)
    compressions = []
    if compress:  # count the warm-up's compression
        run = warm.engine.runner.compressor.run
        warm.engine.runner.compressor.run = lambda jobs: (compressions.append(len(jobs)),
                                                          run(jobs))
    launches = warm.engine.runner._launches if world == 1 else 0
    warm_up(warm.engine.runner, warm.engine.capacity.num_blocks)
    assert compressions == ([1] if compress else [])
    if asynchronous:
        assert warm.engine.runner._launches == launches + 2
    assert [output.token_ids for output in warm.generate(prompts, params, progress=False)] \
        == expected
    assert not compress or warm.last_run.summary["compressions"] > 0
    warm.close()


class _RecordingRunner:
    """The warm-up's view of a runner: its steps and compressions, recorded."""

    def __init__(self, config) -> None:
        self.config = config
        self.device = torch.device("cpu")
        self.widths: list[int] = []
        self.compressions: list = []
        self.compressor = self

    def execute(self, plan, tokens) -> None:
        self.widths += [len(item.seq.block_table) for item in plan.prefill]
        self.widths += [len(seq.block_table) for seq in plan.decode]

    def run(self, jobs) -> None:
        self.compressions.append(jobs)


@pytest.mark.parametrize("max_model_len,compresses", [(None, True), (4096, True), (2176, False), (100, False)])
def test_warm_up_never_builds_a_table_wider_than_max_model_len(max_model_len, compresses):
    """A budget at or above max_model_len (no request can compress): the warm-up's scratch
    request stays within the block tables a CUDA graph was captured with."""
    from zipage.config import ZipageConfig

    config = ZipageConfig(block_size=64, kv_budget=2112, max_model_len=max_model_len)
    runner = _RecordingRunner(config)
    warm_up(runner, num_blocks=1000)
    limit = -(-max_model_len // 64) if max_model_len else config.n_max + 1
    assert max(runner.widths) <= limit
    assert bool(runner.compressions) == compresses


def test_warm_logits_runs_the_lm_head_at_every_row_count_and_changes_nothing(tmp_path):
    """The LM head outside a graph sees 1 .. max_num_seqs rows (a prefill step's sampling rows,
    a decode batch above the graphs): the warm pass runs each count once, so no step's host
    meets cuBLAS's first matmul of a shape (on a GPU that waits for the device to be idle), and
    generation after it is unchanged."""
    torch.set_num_threads(1)
    save_tiny_qwen3(tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = [list(range(3, 40)), list(range(50, 70)), list(range(5, 9))]
    knobs = dict(block_size=16, kv_memory_gb=0.001, compress=False, max_num_seqs=6,
                 dtype="float32", device="cpu")
    with LLM(str(tmp_path), **knobs) as cold:
        expected = [output.token_ids for output in cold.generate(prompts, params, progress=False)]
    with LLM(str(tmp_path), **knobs) as warm:
        runner = warm.engine.runner
        rows, compute = [], runner.model.compute_logits
        runner.model.compute_logits = lambda hidden: (rows.append(len(hidden)), compute(hidden))[1]
        runner.warm_logits()
        runner.model.compute_logits = compute
        assert rows == [1, 2, 3, 4, 5, 6]
        assert [output.token_ids for output in warm.generate(prompts, params, progress=False)] == expected
