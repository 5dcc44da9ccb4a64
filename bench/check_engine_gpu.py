"""GPU check of the engine's decode paths: CUDA-graph replay vs eager, with and without compression.

The graph path stages only the block-table columns a batch uses and runs on the runner's
high-priority stream while async compressions run beside it; the eager path builds its inputs
directly. Both run the same kernels, but the graph path runs the padded bucket size, whose split-K
layout (and so the order of the float sums) differs, and an async batch's completion step depends
on timing; so a few requests may diverge late, hence an agreement threshold, not equality. Random
`random:qwen3-0.6b` weights in float32 (so near-ties in bfloat16 cannot flip a greedy choice),
a small AMC23-shaped trace, EOS ignored. Prints the share of requests whose outputs agree exactly
and the first token index where the others diverge; exits 1 below `--min-agreement`.

Prefill graphs (on by default on a GPU; the plain variants below turn them off to check decode graphs
alone) are covered twice:
- step by step, exactly: prefill and mixed steps (ragged prompts, a prefix-cached chunk, decode
  rows) replayed from the captured graph of their token bucket must give bit-identical logits and
  KV to the same padded forward run eagerly (turning graphs on cannot change a result);
- the mixed step again through the bucket's other graph, the decode section's (the split-K decode
  kernel inside the graph; forced, as its rows are shorter than the rule's threshold): replay ==
  padded eager bit for bit, and its logits within 1e-4 (relative to the largest) of the folded
  graph's (float32: the two sum in different orders);
- the trace variants "+ prefill graphs": decode and prefill graphs against eager, by agreement
  (the padded layout folds decode rows into the prefill launch, so sums differ from eager's).

The decode kernel's balanced split (zipage/decode_grid.py, `takes_balanced_split`): a decode step of
7 short rows and one long one, replayed from the balanced decode graph, against the same step run
eagerly (which picks the balanced split too), bit for bit; and its logits within 1e-4 (relative) of
the batch split's (forced), which sums in another order.

    python bench/check_engine_gpu.py
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch

from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings
from zipage.core.sampling import SamplingParams
from zipage.core.sequence import Sequence
from zipage.core.step import DECODE, MIXED, PREFILL, PrefillItem, StepPlan
from zipage.engine import runner as runner_module
from zipage.engine.builder import build_engine
from zipage.engine.replay import replay_on_engine
from zipage.workloads import make_trace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay_variant import RULES  # noqa: E402  (a sibling script)


def run(trace, config: ZipageConfig, cuda_graphs: bool, model: str,
        prefill_graphs: bool = False) -> dict[str, list[int]]:
    settings = ReplaySettings(model=f"random:{model}", dtype="float32", kv_memory_gb=1.0,
                              config=config)
    _, engine_run = replay_on_engine(trace, settings, "cuda", cuda_graphs=cuda_graphs,
                                     prefill_graphs=prefill_graphs)
    gc.collect()
    torch.cuda.empty_cache()
    return engine_run.tokens


# The decode section's rule forced either way (zipage/prefill_buckets.py, `takes_decode_section`).
SECTION_ALWAYS, FOLD_ALWAYS = RULES["always"], RULES["never"]


def check_close(part: str, name: str, got: torch.Tensor, want: torch.Tensor, failures: list[str]) -> None:
    """Logits of two paths that sum in different orders (float32): within 1e-4 of the largest, else
    `name` joins the failures."""
    error = float((got - want).abs().max() / want.abs().max())
    print(f"{part} {name + ', logits':<40} relative error {error:.1e} (<= 1e-4)", flush=True)
    if not error <= 1e-4:
        failures.append(name)


def prefill_graph_steps_exact(model: str) -> list[str]:
    """Prefill / mixed steps: graph replay against the same padded forward run eagerly, bit for
    bit (logits and the KV the step wrote). Returns the failures."""
    settings = ReplaySettings(model=f"random:{model}", dtype="float32", kv_memory_gb=1.0,
                              config=ZipageConfig(compress=False, block_size=64))
    engine = build_engine(settings, "cuda", cuda_graphs=True)
    runner, blocks = engine.runner, engine.new_scheduler().block_manager
    runner.enable_prefill_graphs()
    vocab = engine.shape.vocab_size
    rule = runner_module.takes_decode_section

    def request(name: str, length: int, outputs: int = 0) -> Sequence:
        seq = Sequence(name, None, 64, prompt_len=length, sampling=SamplingParams(temperature=0.0))
        seq.block_table = [blocks.allocate() for _ in range(length // 64 + 1)]
        seq.set_counters(length - outputs, outputs)
        return seq

    history = {}
    decoding = [request(f"d{i}", 300 + 97 * i, outputs=1) for i in range(5)]
    plans = {
        "one prompt of 100": [PrefillItem(request("a", 100), 0, 100)],
        "ragged prompts 7 + 200 + 33": [PrefillItem(request(n, k), 0, k)
                                        for n, k in (("b", 7), ("c", 200), ("e", 33))],
        "a cached 128 + chunk of 57, partial": [PrefillItem(request("f", 400), 128, 185, False)],
    }
    cases = [(name, StepPlan(step_id=0, kind=PREFILL, prefill=items)) for name, items in plans.items()]
    mixed = StepPlan(step_id=0, kind=MIXED, prefill=[PrefillItem(request("g", 90), 0, 90)], decode=decoding)
    cases.append(("mixed: chunk of 90 + 5 decodes", mixed))
    cases.append(("mixed, decode section", mixed))
    failures, mixed_logits = [], {}
    for name, plan in cases:
        sectioned = name.endswith("decode section")
        runner_module.takes_decode_section = SECTION_ALWAYS if sectioned else FOLD_ALWAYS
        for seq in [item.seq for item in plan.prefill] + plan.decode:
            history[seq.seq_id] = [(31 * i + len(seq.seq_id)) % vocab for i in range(seq.num_tokens)]
        results = []
        for graphs in (runner.prefill_graphs, {}):
            saved, runner.prefill_graphs = runner.prefill_graphs, graphs
            try:
                runner.execute(plan, history)
                logits = runner.last_logits
                results.append((None if logits is None else logits.clone(), runner.kv_cache.clone()))
            finally:
                runner.prefill_graphs = saved
        (graph_logits, graph_kv), (eager_logits, eager_kv) = results
        same = torch.equal(graph_kv, eager_kv) and (
            graph_logits is None and eager_logits is None or torch.equal(graph_logits, eager_logits))
        print(f"prefill graph {name:<40} replay == padded eager: {same}", flush=True)
        if not same:
            failures.append(name)
        if plan is mixed:
            mixed_logits[sectioned] = graph_logits
    runner_module.takes_decode_section = rule
    check_close("prefill graph", "decode section vs folded", mixed_logits[True], mixed_logits[False], failures)
    del engine, runner
    gc.collect()
    torch.cuda.empty_cache()
    return failures


def decode_split_steps_exact(model: str) -> list[str]:
    """A decode step the rule splits balanced: graph replay == eager bit for bit, and within 1e-4
    of the batch split. Returns the failures."""
    settings = ReplaySettings(model=f"random:{model}", dtype="float32", kv_memory_gb=4.0,
                              config=ZipageConfig(compress=False, block_size=64))
    engine = build_engine(settings, "cuda", cuda_graphs=True)
    runner, blocks = engine.runner, engine.new_scheduler().block_manager
    vocab = engine.shape.vocab_size
    rule = runner_module.takes_balanced_split

    def request(name: str, length: int) -> Sequence:
        seq = Sequence(name, None, 64, prompt_len=length, sampling=SamplingParams(temperature=0.0))
        seq.block_table = [blocks.allocate() for _ in range(length // 64 + 1)]
        seq.set_counters(length - 1, 1)
        return seq

    rows = [request(f"s{i}", 300 + 11 * i) for i in range(7)] + [request("long", 5000)]
    plan = StepPlan(step_id=0, kind=DECODE, decode=rows)
    history = {seq.seq_id: [(31 * i + len(seq.seq_id)) % vocab for i in range(seq.num_tokens)] for seq in rows}
    lengths = torch.tensor([seq.kv_len + 1 for seq in rows]).numpy()
    failures = []
    if runner.decode_split(lengths, 8) != "balanced" or 8 not in runner.balanced_graphs:
        return ["the rule did not take the balanced split at 8 rows"]
    logits = {}
    for name, graphs, balanced_graphs, takes in (
            ("graph", runner.graphs, runner.balanced_graphs, rule),
            ("eager", {}, {}, rule),
            ("batch split", {}, {}, lambda *_, **__: False)):
        saved = runner.graphs, runner.balanced_graphs
        runner.graphs, runner.balanced_graphs = graphs, balanced_graphs
        runner_module.takes_balanced_split = takes
        try:
            runner.execute(plan, history)
            logits[name] = runner.last_logits.clone()
        finally:
            runner.graphs, runner.balanced_graphs = saved
            runner_module.takes_balanced_split = rule
    same = torch.equal(logits["graph"], logits["eager"])
    print(f"decode split {'balanced graph replay == eager':<40} {same}", flush=True)
    if not same:
        failures.append("balanced decode graph vs eager")
    check_close("decode split", "balanced vs batch split", logits["eager"], logits["batch split"], failures)
    del engine, runner
    gc.collect()
    torch.cuda.empty_cache()
    return failures


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--min-agreement", type=float, default=0.9)
    args = parser.parse_args()
    # $OUT when set (the GPU harness collects it), else the ignored runs/ of the repository.
    out = Path(os.environ.get("OUT")
               or Path(__file__).resolve().parents[1] / "runs" / "check_engine_gpu")
    out.mkdir(parents=True, exist_ok=True)
    trace = make_trace("amc23", 0, num_questions=4, samples_per_question=8, max_output_len=600)
    variants = {
        "full-kv": ZipageConfig(compress=False, block_size=64),
        "zipage async": ZipageConfig(block_size=64, kv_budget=256),
        "zipage sync": ZipageConfig(block_size=64, kv_budget=256, async_compress=False),
    }
    report, failed = {}, False
    step_failures = prefill_graph_steps_exact(args.model)
    report["prefill graph steps"] = dict(exact=not step_failures, failures=step_failures)
    failed |= bool(step_failures)
    split_failures = decode_split_steps_exact(args.model)
    report["decode split steps"] = dict(exact=not split_failures, failures=split_failures)
    failed |= bool(split_failures)
    variants["full-kv + prefill graphs"] = variants["full-kv"]
    variants["zipage sync + prefill graphs"] = variants["zipage sync"]
    for name, config in variants.items():
        torch.manual_seed(0)
        graphs = run(trace, config, True, args.model, prefill_graphs=name.endswith("prefill graphs"))
        torch.manual_seed(0)
        eager = run(trace, config, False, args.model)
        same = [seq_id for seq_id in graphs if graphs[seq_id] == eager[seq_id]]
        diverged = sorted(next(i for i, (a, b) in enumerate(zip(graphs[s], eager[s])) if a != b)
                          for s in graphs if s not in same)
        agreement = len(same) / len(graphs)
        failed |= agreement < args.min_agreement
        report[name] = dict(agreement=agreement, first_divergence=diverged[:8])
        print(f"{name:<30} graphs == eager for {len(same)}/{len(graphs)} requests; "
              f"divergence at token {diverged[:8]}", flush=True)
    (out / "check_engine_gpu.json").write_text(json.dumps(report, indent=2))
    print(f"RESULT: {'FAIL' if failed else 'PASS'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
