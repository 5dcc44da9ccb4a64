"""Golden step-by-step decision logs, one small trace per scheduling mode.

Any change in scheduling behaviour shows up as a diff of tests/golden/*.log in review. After an
intended change, regenerate with `ZIPAGE_UPDATE_GOLDEN=1 pytest tests/test_golden_logs.py` and
read the diff before committing it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from zipage.config import ZipageConfig
from zipage.core.scheduler import Scheduler
from zipage.core.sequence import Sequence
from zipage.sim.instant import InstantDriver

GOLDEN = Path(__file__).parent / "golden"
# The modes without "chunked" in their name prefill whole prompts in steps of their own.
WHOLE = dict(chunked_prefill=False)
MODES = {
    "constrained": dict(hybrid=False, prefix_cache=False, **WHOLE),
    "hybrid": dict(hybrid=True, prefix_cache=False, **WHOLE),
    "hybrid_prefix": dict(hybrid=True, prefix_cache=True, **WHOLE),
    # Chunked prefill with a 24-token step budget: prompts split, decodes and chunks share steps.
    "constrained_chunked": dict(hybrid=False, prefix_cache=False, chunked_prefill=True,
                                max_num_batched_tokens=24),
    "hybrid_prefix_chunked": dict(hybrid=True, prefix_cache=True, chunked_prefill=True,
                                  max_num_batched_tokens=24),
    # Per-request budgets (MIXED_BUDGETS), and the elastic policy on a pool with room to spare
    # (docs/architecture.md, 'Per-request and elastic budgets').
    "hybrid_prefix_mixed": dict(hybrid=True, prefix_cache=True, budgets=True, **WHOLE),
    "hybrid_prefix_elastic": dict(hybrid=True, prefix_cache=True, budgets=True,
                                  budget_policy="elastic", num_blocks=20, **WHOLE),
    # Compressions keep every prompt whole (docs/architecture.md, 'Compression scope').
    "hybrid_prefix_output": dict(hybrid=True, prefix_cache=True, compress_scope="output",
                                 num_blocks=16, **WHOLE),
    # Priority classes (PRIORITIES) with 2 steps of aging a class (docs/architecture.md,
    # 'Waiting-queue policies'): later requests of a better class overtake, victims by class.
    "hybrid_prefix_priority": dict(hybrid=True, prefix_cache=True, priorities=True,
                                   scheduling_policy="priority", priority_aging_s=2.0, **WHOLE),
    # A host tier of 3 slots (docs/architecture.md, 'Host tier'): prompt blocks the pool reuses
    # or a compression rewrites are saved, and f's shared prefix comes back from host memory.
    "hybrid_prefix_host": dict(hybrid=True, prefix_cache=True, host_blocks=3, **WHOLE),
}
# Budgets of 1 to 3 blocks (N_max 2 to 4) around the default 32 (N_max 3); None keeps the default.
MIXED_BUDGETS = {"a": 48, "b": 16, "c": None, "d": 16, "e": 48, "f": None}
PRIORITIES = {"a": 2, "b": 1, "c": 2, "d": 0, "e": -1, "f": 0}


def golden_trace() -> list[Sequence]:
    """Six requests on 16-token blocks (N_max = 3): three share a 40-token prompt prefix, one
    has a prompt longer than N_max blocks, one is short/short, arrivals over the first steps."""
    shared = list(range(500, 540))
    prompts = [
        ("a", shared + [1, 2, 3], 70, 0),
        ("b", shared + [4, 5], 60, 1),  # hits a's two full prefix blocks
        ("c", list(range(1000, 1050)), 40, 1),  # 50 tokens: 4 blocks > N_max
        ("d", list(range(2000, 2010)), 5, 2),
        ("e", list(range(3000, 3020)), 50, 3),
        ("f", shared + [6], 30, 5),
    ]
    return [Sequence(seq_id, tokens, output, arrival_s=arrival)
            for seq_id, tokens, output, arrival in prompts]


def decision_log(mode: str) -> str:
    knobs = dict(MODES[mode])
    num_blocks = knobs.pop("num_blocks", 10)
    budgets = knobs.pop("budgets", False)
    priorities = knobs.pop("priorities", False)
    host_blocks = knobs.pop("host_blocks", 0)
    config = ZipageConfig(block_size=16, window=4, kv_budget=32, async_compress=False, **knobs)
    scheduler = Scheduler(config, num_blocks=num_blocks, num_query_slots=2,
                          num_host_blocks=host_blocks)
    sequences = golden_trace()
    if budgets:
        for seq in sequences:
            seq.kv_budget = MIXED_BUDGETS[seq.seq_id]
    if priorities:
        for seq in sequences:
            seq.priority = PRIORITIES[seq.seq_id]
    run = InstantDriver(scheduler, check=True, log_decisions=True).run(sequences)
    assert run.summary["completed"] == 6
    return "\n".join(run.decision_log) + "\n"


@pytest.mark.parametrize("mode", list(MODES))
def test_decision_log_matches_golden(mode):
    path = GOLDEN / f"{mode}.log"
    log = decision_log(mode)
    if os.environ.get("ZIPAGE_UPDATE_GOLDEN"):
        path.write_text(log)
    assert path.exists(), f"missing {path}: run with ZIPAGE_UPDATE_GOLDEN=1 once"
    assert log == path.read_text(), f"scheduling decisions changed in mode {mode}"


def test_modes_really_differ():
    logs = {mode: decision_log(mode) for mode in MODES}
    assert len(set(logs.values())) == len(MODES)
