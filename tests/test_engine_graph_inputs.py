"""The decode-graph input path on the CPU: the runner stages each batch into the graphs' static
tensors (only the block-table columns the batch uses, padded rows, stale columns left behind by
wider batches and by compactions), then replays. Here a stand-in "graph" runs the model eagerly on
those static tensors, so the staging is checked against the plain eager path token for token."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_engine import GREEDY, prompts_with_shared_prefix, tiny_model  # noqa: E402,F401
from test_engine_compression import SMALL  # noqa: E402

from zipage import LLM  # noqa: E402
from zipage.engine.context import forward_context  # noqa: E402

LADDER = (1, 2, 4, 8)


class EagerReplay:
    """Stands in for a captured CUDA graph: the same forward, on the same static tensors."""

    def __init__(self, runner, size: int) -> None:
        self.runner, self.size = runner, size

    def replay(self) -> None:
        runner, size = self.runner, self.size
        static = runner.graph_inputs
        with forward_context(runner.graph_context(size)):
            hidden = runner.model(static["columns"][0, :size], static["columns"][1, :size])
            static["logits"][:size] = runner.model.compute_logits(hidden)


def with_graph_path(llm: LLM) -> LLM:
    runner = llm.engine.runner
    runner.allocate_graph_inputs(LADDER[-1])
    runner.graphs = {size: EagerReplay(runner, size) for size in LADDER}
    return llm


@pytest.mark.parametrize("knobs", [dict(compress=False, block_size=16, kv_memory_gb=0.002),
                                   dict(SMALL, async_compress=False), SMALL],
                         ids=["full-kv", "compress-sync", "compress-async"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async-scheduling"])
def test_graph_input_staging_matches_eager(tiny_model, knobs, async_scheduling):  # noqa: F811
    """With async scheduling the staged rows take the running step's tokens on the device
    (`ModelRunner._feed_tokens` into the graph's token column) and alternate staging buffers."""
    directory, _ = tiny_model
    prompts = prompts_with_shared_prefix()
    eager = LLM(str(directory), **knobs).generate(prompts, GREEDY, progress=False)
    staged_llm = with_graph_path(LLM(str(directory), **knobs, async_scheduling=async_scheduling))
    staged = staged_llm.generate(prompts, GREEDY, progress=False)
    assert [o.token_ids for o in staged] == [o.token_ids for o in eager]
    # The staged path really ran, with padded rows (5 requests replay the 8-row graph) and, with
    # compression on, with tables that shrank under columns written by earlier, wider steps.
    tables = staged_llm.engine.runner.graph_inputs["block_tables"]
    assert tables[:5].count_nonzero() > 0
    if knobs.get("compress", True):
        assert staged_llm.last_run.summary["compressions"] > 0
