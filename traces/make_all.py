"""Regenerate every shipped workload trace in this folder from its generator with seed 0.

The shipped files are exactly what `zipage.workloads.make_trace(kind, seed=0)` produces (with
the arguments below for the scaled and session traces); `tests/test_trace.py` and
`tests/test_session_workloads.py` regenerate them and fail if a file drifts from its generator. Run
`python traces/make_all.py` after changing a generator, and commit the files it rewrites.
"""

from __future__ import annotations

import sys
from pathlib import Path

TRACES_DIR = Path(__file__).resolve().parent
# Lets the script run from a plain checkout, without `pip install -e .`.
sys.path.insert(0, str(TRACES_DIR.parent))

from zipage.trace import save_trace  # noqa: E402
from zipage.workloads import WORKLOADS, make_trace  # noqa: E402

SHIPPED_SEED = 0
# Scaled variants: file stem -> (kind, generator arguments). `amc23-headline` is the GPU headline's
# trace (docs/BENCHMARKS.md, 'Headline'): the paper's AMC23 with lengths / 4, 16 questions x 8 samples.
SCALED = {
    "amc23-headline": ("amc23", dict(num_questions=16, samples_per_question=8, max_output_len=4096)),
}
# Session traces (zipage/session_workloads.py), written as JSON Lines: file stem -> (kind,
# generator arguments). `agent-sessions` is the coding agent at 1/8 of its token counts (~8.5k-token
# prompts, compacted before 25k) so a single GPU, or the CPU engine, replays it with a 32k-context
# model; `tests/test_session_workloads.py` checks each equals its generator.
SESSIONS = {
    "chat-sessions": ("chat-sessions", {}),
    "agent-sessions": ("agent-sessions", dict(sessions=24, scale=0.125)),
}


def main() -> None:
    for kind in WORKLOADS:
        trace = make_trace(kind, seed=SHIPPED_SEED)
        path = TRACES_DIR / f"{kind}.json"
        save_trace(trace, path)
        print(f"{path}: {len(trace.requests)} requests")
    for stem, (kind, arguments) in SCALED.items():
        trace = make_trace(kind, SHIPPED_SEED, **arguments)
        path = TRACES_DIR / f"{stem}.json"
        save_trace(trace, path)
        print(f"{path}: {len(trace.requests)} requests")
    for stem, (kind, arguments) in SESSIONS.items():
        trace = make_trace(kind, SHIPPED_SEED, **arguments)
        path = TRACES_DIR / f"{stem}.jsonl"
        save_trace(trace, path)
        print(f"{path}: {len(trace.requests)} requests")


if __name__ == "__main__":
    main()
