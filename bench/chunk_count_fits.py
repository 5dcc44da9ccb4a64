"""Price the steps `bench/chunk_count_gpu.py` measured with profiles, by chunk count: how far a
profile's per-chunk terms (prefill and mixed fits' `per_sequence_s`) hold at 1-128 chunks a step
(issue #49; docs/cost_model.md, 'Where the headline's TTFT p50 goes'). For each measured step of
interest (the median of its repeats) it prints the measured time, each profile's price, and the
price without the per-chunk term. CPU, seconds.

    python bench/chunk_count_fits.py CHUNK_COUNT_JSON [PROFILE ...]
        (default profiles: the shipped 8B Zipage and Full KV ones, each for its mode)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from chunk_count_gpu import step_of_interest

from zipage.sim.calibrated import CalibratedCostModel
from zipage.sim.cost_model import StepWork

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = {"zipage": ROOT / "sim/profiles/qwen3-8b-h200-b64-k512-zipage.json",
           "fullkv": ROOT / "sim/profiles/qwen3-8b-h200-b64-k512-fullkv.json"}


def work(step: dict) -> StepWork:
    return StepWork(step["n_decode"], step["decode_context_tokens"], num_prefill=step["n_prefill"],
                    num_sampled_prefill=step["n_prefill"], prefill_tokens=step["prefill_tokens"],
                    attention_pairs=step["attention_pairs"],
                    decode_max_context=step["decode_max_context"])


def chunk_term(model: CalibratedCostModel, step: dict) -> float:
    """What the step's price holds for its chunks: s * chunks, outside the fits' max (the mixed
    fit's s beside decode rows, the prefill fit's without)."""
    fit = model.mixed_fit if step["n_decode"] else model.prefill_fit
    return fit.per_sequence_s * step["n_prefill"]


def main(path: str, profiles: list[str]) -> None:
    report = json.loads(Path(path).read_text())
    models = {mode: CalibratedCostModel.from_profile(profile)
              for mode, profile in (dict(zip(SHIPPED, profiles)) or SHIPPED).items()}
    cases: dict[tuple[str, str], list[dict]] = {}
    for run in report["runs"]:
        step = step_of_interest(run["steps"], run["trace"].startswith("mixed"))
        if step is not None:
            cases.setdefault((run["mode"], run["trace"]), []).append(step)
    print(f"{'mode':<7} {'trace':<16} {'chunks':>6} {'decodes':>7} {'tokens':>6} "
          f"{'measured ms':>11} {'profile ms':>10} {'without chunk term':>18}")
    for (mode, trace), steps in cases.items():
        if mode not in models:
            continue
        model = models[mode]
        measured = statistics.median((step["t_end"] - step["t_start"]) * 1e3 for step in steps)
        step = steps[0]
        priced = model.forward_time_for(work(step)) * 1e3
        flat = priced - chunk_term(model, step) * 1e3
        print(f"{mode:<7} {trace:<16} {step['n_prefill']:>6} {step['n_decode']:>7} "
              f"{step['prefill_tokens']:>6} {measured:>11.2f} {priced:>10.2f} {flat:>18.2f}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
