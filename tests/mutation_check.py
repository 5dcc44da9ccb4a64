"""Mutation check: does some test fail when a scheduling rule is broken?

    python tests/mutation_check.py             # every mutation (a few minutes on 2 cores)
    python tests/mutation_check.py --list      # the mutations, nothing run
    python tests/mutation_check.py --check-snippets   # every snippet still found? (instant)
    python tests/mutation_check.py NAME...     # only these (substrings of the names)

Each mutation is one deliberate break of a rule of docs/architecture.md, written as (file, exact
old snippet, new snippet) in MUTATIONS below. The tool copies the package and the tests to a
temporary directory (never touching the working tree), checks that the unmutated copy passes,
then for each mutation replaces the snippet in the copy, runs TESTS there (the core property
tests, the preemption witnesses and the rule witnesses, each stopping at its first failure; a
mutation may name the groups that can reach its rule) and prints one line per mutation:
"caught" (with the test that failed and why), "survived", or "not applicable: snippet not
found". It exits 0 only if every mutation was caught.

Refreshing after a merge: a snippet must occur exactly once in its file. When the code around a
rule changes, edit the `old`/`new` pair here to the new code (keep the break the same) and run
`--check-snippets`; tests/test_mutation_table.py runs that check in the normal test run.

Why not mutmut or cosmic-ray: they mutate operators at random all over a module, so most of
their mutants break nothing the paper specifies (or are equivalent), a run over the core takes
hours on this machine, and their report says which line survived, not which rule. What we want
to know is narrower: is each named rule guarded? A hand-written list of semantic breaks answers
exactly that, runs in minutes, and is reviewed like code (docs/results/mutation-check.md).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    old: str
    new: str
    # The TESTS groups run against it; None: all of them. Only groups whose traces can reach the
    # rule are worth the minutes (see RULE_WITNESSES).
    tests: tuple[str, ...] | None = None


SCHEDULER = "zipage/core/scheduler.py"
SLOTS = "zipage/core/slots.py"
VICTIMS = "zipage/core/victims.py"
COMPRESSIONS = "zipage/core/compressions.py"
PREFILL = "zipage/core/prefill.py"
BLOCKS = "zipage/core/block_manager.py"
HOST_TIER = "zipage/core/host_tier.py"
WAITING = "zipage/core/waiting.py"
STEADY = "zipage/core/steady.py"
ADMISSION = "zipage/core/admission.py"
# The core property tests and the preemption witnesses run no chunked prefill, no per-request
# budget, no elastic policy and no abort, so against a break of those rules they can only pass;
# such a mutation runs the rule witnesses alone (a minute less each on a loaded 2-core machine).
RULE_WITNESSES = ("rule witnesses",)
FORK_WITNESSES = ("fork witnesses",)  # the samples rule: only its own witnesses reach it
PROPERTY_TESTS = ("property tests",)  # the priority modes draw priorities; no witness does
SCORING_TESTS = ("scoring tests",)  # the policies' own tests; no scheduling trace reaches them
# Losing a save breaks no invariant, only what the tier gives back: its own tests measure that.
HOST_TIER_TESTS = ("host tier tests",)
# Async scheduling's protocol: only a driver that settles a step after the next plan reaches it.
ASYNC_TESTS = ("async tests",)

MUTATIONS = [
    # ---- async scheduling (docs/architecture.md, 'Async scheduling')
    Mutation("async: a stop of a request the next plan preempted is ignored (it recomputes past "
             "its stop)", SCHEDULER,
             "                    elif seq.status is WAITING:  # preempted by the next plan",
             "                    elif False:  # preempted by the next plan", tests=ASYNC_TESTS),
    Mutation("async: a request stopped inside a compression job leaves before the job ends",
             SCHEDULER,
             "        if seq.compressing:\n            self.steady.leave(seq)\n",
             "        if False:\n            self.steady.leave(seq)\n", tests=ASYNC_TESTS),
    Mutation("async: a first token's time never set when its step settles", SCHEDULER,
             "                if seq.first_token_time is None:\n                    seq.first_token_time = t_end\n",
             "                if False:\n                    seq.first_token_time = t_end\n",
             tests=ASYNC_TESTS),
    # ---- the four breaks of issue 11
    Mutation("preempted request to the back of waiting", SCHEDULER,
             "        self.waiting.appendleft(seq)\n        plan.preempted.append(seq)",
             "        self.waiting.append(seq)\n        plan.preempted.append(seq)"),
    Mutation("prefix cache: the victim may be a compressed request", VICTIMS,
             "                    if seq.num_compressions == 0 and not seq.compressing\n",
             "                    if not seq.compressing\n"),
    Mutation("constrained scheduling also preempts slot holders", VICTIMS,
             "        if self.config.prefix_cache or self.shared:\n            # Compressing a shared",
             "        if self.config.prefix_cache or self.shared or not self.config.hybrid:\n"
             "            # Compressing a shared"),
    Mutation("hybrid scheduling also preempts slot holders", VICTIMS,
             "        if self.config.prefix_cache or self.shared:\n            # Compressing a shared",
             "        if self.config.prefix_cache or self.shared or self.config.hybrid:\n"
             "            # Compressing a shared"),
    Mutation("hybrid: a preempted request borrows reserved blocks again", PREFILL,
             "return not seq.num_preemptions or lending.fits_unreserved(",
             "return True or lending.fits_unreserved(", tests=("witness traces",)),
    Mutation("prefix-cache deadlock-avoidance preemption removed", VICTIMS,
             "        if self.config.prefix_cache or self.shared:\n            # Compressing a shared",
             "        if False:\n            # Compressing a shared"),
    Mutation("forks share blocks, yet only the prefix cache turns the uncompressed rule on",
             VICTIMS,
             "        if self.config.prefix_cache or self.shared:\n            # Compressing a shared",
             "        if self.config.prefix_cache:\n            # Compressing a shared",
             tests=FORK_WITNESSES),
    Mutation("a victim whose recomputation cannot fit the pool", VICTIMS,
             "        return -(-seq.num_tokens // self.block_size) <= self.block_manager.num_blocks",
             "        return True"),
    # ---- the rules the audit found guarded
    Mutation("N_max off by one (the scheduler's cap)", ADMISSION,
             "        return budget // self.block_size + 1 + self.pinned_of(seq)\n",
             "        return budget // self.block_size + 2 + self.pinned_of(seq)\n"),
    # ---- the compression scope (docs/architecture.md, 'Compression scope')
    Mutation("output scope: a compression rewrites the prompt's blocks", COMPRESSIONS,
             "        pinned = seq.pinned\n        table = seq.block_table\n",
             "        pinned = 0\n        table = seq.block_table\n"),
    Mutation("output scope: the prompt's blocks not counted in N_max", ADMISSION,
             "        return budget // self.block_size + 1 + self.pinned_of(seq)\n",
             "        return budget // self.block_size + 1\n"),
    Mutation("compression trigger off by one (N > N_max instead of N >= N_max)", SCHEDULER,
             "            if self.compress and len(table) >= seq.n_max:",
             "            if self.compress and len(table) > seq.n_max:"),
    Mutation("refcount decrement skipped for a shared block", BLOCKS,
             "            count = refcount[block] - 1\n",
             "            count = refcount[block] - (1 if refcount[block] == 1 else 0)\n"),
    Mutation("freed slot given to the last request without one", SLOTS,
             "        for seq in running:\n            if seq.query_slot is None:\n",
             "        for seq in reversed(running):\n            if seq.query_slot is None:\n"),
    Mutation("window-slot rule off by one (offset > b - w)", SLOTS,
             "                and token_index % b >= b - self.window)",
             "                and token_index % b > b - self.window)"),
    Mutation("compression targets not dropped from the prefix index", BLOCKS,
             "                self._save(block, self.block_hash[block])\n"
             "            self._forget_hash(block)\n",
             "                self._save(block, self.block_hash[block])\n            pass\n"),
    # ---- the host tier (docs/architecture.md, 'Host tier')
    Mutation("host tier: a slot this step loads from may be reused by a save", HOST_TIER,
             "        self.pinned.add(slot)\n", "        pass\n", tests=PROPERTY_TESTS),
    Mutation("host tier: two saves into one slot in a step both kept", BLOCKS,
             "        if len(saves) > 1 and len({slot for _, slot in saves}) < len(saves):",
             "        if False:", tests=PROPERTY_TESTS),
    Mutation("host tier: the last prompt block loaded from the host", BLOCKS,
             "        for block_hash in seq.prompt_block_hashes[gpu_hits:(num_tokens - 1) // self.block_size]:",
             "        for block_hash in seq.prompt_block_hashes[gpu_hits:num_tokens // self.block_size]:",
             tests=PROPERTY_TESTS),
    Mutation("host tier: a compression target's prompt block not saved before it is rewritten",
             BLOCKS,
             "            if self.host is not None and self.block_hash[block] is not None:\n",
             "            if False:\n", tests=HOST_TIER_TESTS),
    # ---- more rules
    Mutation("rule 5: a shared block reused as a compression target", BLOCKS,
             "        own = [block for block in table if refcount[block] == 1]",
             "        own = [block for block in table if refcount[block] >= 1]"),
    Mutation("rule 7: the last prompt block taken from the prefix cache", BLOCKS,
             "        for block_hash in seq.prompt_block_hashes[:(num_tokens - 1) // self.block_size]:",
             "        for block_hash in seq.prompt_block_hashes[:num_tokens // self.block_size]:"),
    Mutation("window-query range off by one (one window query not written)", "zipage/core/window.py",
             "        first = max(start, last_block_start + b - self.window)",
             "        first = max(start, last_block_start + b - self.window + 1)"),
    # ---- chunked prefill (docs/architecture.md, 'Chunked prefill')
    Mutation("chunked: a step that preempted still admits", SCHEDULER,
             "        if self.waiting and budget > 0 and not plan.preempted:",
             "        if self.waiting and budget > 0:", tests=RULE_WITNESSES),
    Mutation("chunked: prompt chunks planned before the decodes", SCHEDULER,
             "        self._schedule_decode(plan)\n"
             "        budget = self.step_tokens - plan.num_decode\n",
             "        budget = self.step_tokens - len(self.steady)\n"
             "        self._schedule_chunks_first(plan, budget)\n"
             "        self._schedule_decode(plan)\n"
             "        return\n"
             "\n"
             "    def _schedule_chunks_first(self, plan, budget):\n", tests=RULE_WITNESSES),
    Mutation("chunked: the token budget not reduced by the decode tokens", SCHEDULER,
             "        budget = self.step_tokens - plan.num_decode\n",
             "        budget = self.step_tokens\n", tests=RULE_WITNESSES),
    Mutation("chunked: admissions before the running prompts continue", SCHEDULER,
             "        budget = self.step_tokens - plan.num_decode\n"
             "        for seq in list(self.prefilling):\n",
             "        budget = self.step_tokens - plan.num_decode\n"
             "        continuing = list(self.prefilling)\n"
             "        if self.waiting and budget > 0 and not plan.preempted:\n"
             "            self._schedule_prefill(plan, budget)\n"
             "            budget -= sum(item.num_new_tokens for item in plan.prefill)\n"
             "        for seq in continuing:\n", tests=RULE_WITNESSES),
    Mutation("chunked: a chunk one token short of the last samples", PREFILL,
             "        samples = end == seq.prompt_len + seq.settled_output_tokens  # (`num_tokens`)\n",
             "        samples = end >= seq.prompt_len + seq.settled_output_tokens - 1\n",
             tests=RULE_WITNESSES),
    Mutation("chunked: a chunk indexes the prompt block it has not completed", PREFILL,
             "        self.block_manager.register_prompt_blocks(seq, start // self.block_size,\n"
             "                                                  end // self.block_size)",
             "        self.block_manager.register_prompt_blocks(seq, start // self.block_size,\n"
             "                                                  -(-end // self.block_size))",
             tests=RULE_WITNESSES),
    Mutation("chunked: a request decodes (may compress) before its prompt is whole", SCHEDULER,
             "            seq.set_counters(item.num_tokens, seq.settled_output_tokens)\n"
             "            return\n",
             "            seq.set_counters(item.num_tokens, seq.settled_output_tokens)\n"
             "            self._pending.append(seq)\n"
             "            return\n", tests=RULE_WITNESSES),
    Mutation("chunked: a prompt longer than the step budget is rejected", ADMISSION,
             "        if not self.config.chunked_prefill and prompt > "
             "self.step_tokens:",
             "        if prompt > self.step_tokens:", tests=RULE_WITNESSES),
    Mutation("chunked: a request leaving running keeps its place among the running prompts",
             SCHEDULER,
             "        self.prefilling.pop(seq, None)\n        self.slots.release(seq)\n",
             "        self.slots.release(seq)\n", tests=RULE_WITNESSES),
    # ---- per-request and elastic budgets (docs/architecture.md, 'Per-request and elastic
    # budgets')
    Mutation("budget: a request's own budget ignored in its N_max", ADMISSION,
             "        budget = self.config.kv_budget if seq.kv_budget is None else seq.kv_budget",
             "        budget = self.config.kv_budget", tests=RULE_WITNESSES),
    Mutation("budget: a slot reserves the default N_max, not its holder's", ADMISSION,
             "        seq.slot_blocks = seq.n_max if seq.n_max < whole else whole",
             "        seq.slot_blocks = self.n_max if self.n_max < whole else whole",
             tests=RULE_WITNESSES),
    Mutation("budget: a later request overtakes the foremost the pool cannot back", SLOTS,
             "                    break  # the foremost waits until enough holders finish",
             "                    continue  # the foremost waits until enough holders finish",
             tests=RULE_WITNESSES),
    Mutation("elastic: borrowed blocks kept although somebody needs memory", COMPRESSIONS,
             "        if not self.elastic or memory_demand():",
             "        if not self.elastic:", tests=RULE_WITNESSES),
    Mutation("elastic: the head of waiting short of blocks is no demand", SCHEDULER,
             "        return bool(self._starved) or self.prefill.head_short_of_blocks()",
             "        return bool(self._starved)", tests=RULE_WITNESSES),
    Mutation("elastic: grows without a free block left per running request", COMPRESSIONS,
             "        if manager.num_free_blocks - 1 >= len(self.running):",
             "        if manager.num_free_blocks >= 1:", tests=RULE_WITNESSES),
    Mutation("elastic: a shrink without demand goes below the floor", COMPRESSIONS,
             "            return held\n        return floor\n",
             "            return held\n        return floor - 1\n", tests=RULE_WITNESSES),
    Mutation("elastic: preempts although a borrower could give blocks back", SCHEDULER,
             "            if not (self.elastic and self.compressions.reclaimable_borrower(seq)):",
             "            if True:", tests=RULE_WITNESSES),
    Mutation("elastic: holds although holding needs fresh blocks", COMPRESSIONS,
             "        if held > floor and self.fresh_for_compression(seq, held) == 0:",
             "        if held > floor:", tests=RULE_WITNESSES),
    # ---- aborts (Scheduler.abort)
    Mutation("abort: a running request's blocks are not released", SCHEDULER,
             "                else:\n"
             "                    self._release(seq, SequenceStatus.ABORTED, self.aborted)\n",
             "                else:\n"
             "                    del self.running[seq]\n"
             "                    self.prefilling.pop(seq, None)\n"
             "                    self.slots.release(seq)\n"
             "                    self._resource_version += 1\n"
             "                    seq.status = SequenceStatus.ABORTED\n"
             "                    self.aborted.append(seq)\n", tests=RULE_WITNESSES),
    Mutation("abort: a request inside the in-flight batch is released at once", SCHEDULER,
             "                if seq.compressing:  # only an async batch holds it between steps",
             "                if False:  # only an async batch holds it between steps",
             tests=RULE_WITNESSES),
    Mutation("abort: a request aborted inside a batch resumes when the batch completes",
             SCHEDULER,
             "            if job.seq in self._abort_after_batch:",
             "            if False:", tests=RULE_WITNESSES),
    Mutation("abort: an aborted waiting request stays in waiting (and is admitted)", SCHEDULER,
             "        self.waiting.remove(seq)\n        self._forget_blocked(seq)\n",
             "        self._forget_blocked(seq)\n", tests=RULE_WITNESSES),
    # ---- samples of one prompt (forks)
    Mutation("fork: the leader's partial last block shared instead of copied", PREFILL,
             "            table = leader.block_table[:full]\n"
             "            manager.share(table)\n"
             "            copy = None\n"
             "            if partial:",
             "            table = leader.block_table[:-(-prompt_len // b)]\n"
             "            manager.share(table)\n"
             "            copy = None\n"
             "            if False:", tests=FORK_WITNESSES),
    Mutation("fork: a prompt that wrote window queries is forked", PREFILL,
             "        if self.compress and prompt_len > slots.first_slot_token(0, leader.n_max):",
             "        if False:", tests=FORK_WITNESSES),
    Mutation("fork: forks overtake max_num_seqs", PREFILL,
             "            if len(self.running) >= self.config.max_num_seqs:\n"
             "                break\n"
             "            takes_slot = self.compress and slots.can_take(seq)\n"
             "            if self.compress and not takes_slot and (\n"
             "                    not self.config.hybrid or slots.needs_slot_to_start(seq, "
             "prompt_len)\n",
             "            takes_slot = self.compress and slots.can_take(seq)\n"
             "            if self.compress and not takes_slot and (\n"
             "                    not self.config.hybrid or slots.needs_slot_to_start(seq, "
             "prompt_len)\n", tests=FORK_WITNESSES),
    Mutation("fork: constrained scheduling forks without a query slot", PREFILL,
             "                    not self.config.hybrid or slots.needs_slot_to_start(seq, "
             "prompt_len)\n",
             "                    slots.needs_slot_to_start(seq, prompt_len)\n",
             tests=FORK_WITNESSES),
    Mutation("fork: a request that needs its prompt's logits maps prefix-cache blocks", BLOCKS,
             "        if not self.prefix_cache or seq.prompt_logits:",
             "        if not self.prefix_cache:", tests=FORK_WITNESSES),
    # ---- a cost feature both twins must count alike (not a rule: the invariants guard it)
    Mutation("shared KV: a released shared block keeps its extra holder", BLOCKS,
             "            else:\n                self.extra_holders -= 1\n",
             "\n", tests=FORK_WITNESSES),
    Mutation("longest decode context: kept after the request that held it left", STEADY,
             "                self._max_offset = None  # it held the largest",
             "                pass  # it held the largest"),
    # ---- waiting-queue policies (docs/architecture.md, 'Waiting-queue policies')
    Mutation("priority: the waiting queue ignores the class (arrival order)", WAITING,
             "    return seq.priority * aging_s + seq.arrival_s\n",
             "    return seq.arrival_s\n", tests=PROPERTY_TESTS),
    Mutation("priority: no aging (the class alone, then arrival)", WAITING,
             "    return seq.priority * aging_s + seq.arrival_s\n",
             "    return seq.priority * 1e9 + seq.arrival_s\n", tests=PROPERTY_TESTS),
    Mutation("priority: a preempted request goes to the front", WAITING,
             "    appendleft = append  # a preempted request",
             "    def appendleft(self, seq):\n"
             "        seq.queue_key = (float('-inf'), -self._queued)\n"
             "        self._queued += 1\n"
             "        self.append(seq)\n"
             "    # a preempted request", tests=PROPERTY_TESTS),
    Mutation("priority: the victim is the last admitted, whatever its class", VICTIMS,
             "        if self.by_priority:\n            aging = self.config.priority_aging_s",
             "        if False:\n            aging = self.config.priority_aging_s",
             tests=PROPERTY_TESTS),
    # ---- scoring policies (kernels/scoring, zipage/scoring.py): each policy's reference keeps
    # what its paper keeps, and a request is scored with its own policy
    Mutation("scoring: streaming keeps no sink entries", "kernels/scoring/streaming.py",
             'scores = recency.masked_fill(positions < SINK_ENTRIES, float("inf"))',
             "scores = recency", tests=SCORING_TESTS),
    Mutation("scoring: keydiff keeps the keys most like the mean", "kernels/scoring/keydiff.py",
             "return with_window(-similarity.transpose(0, 1), params.window), None",
             "return with_window(similarity.transpose(0, 1), params.window), None",
             tests=SCORING_TESTS),
    Mutation("scoring: vnorm keeps the smallest values", "kernels/scoring/vnorm.py",
             "return with_window(norms.transpose(0, 1), params.window), None",
             "return with_window(-norms.transpose(0, 1), params.window), None",
             tests=SCORING_TESTS),
    Mutation("scoring: snapkv max-pools instead of averaging", "kernels/scoring/snapkv.py",
             "pooled = torch.nn.functional.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2)",
             "pooled = torch.nn.functional.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)",
             tests=SCORING_TESTS),
    Mutation("scoring: rkv weighs attention and redundancy the other way round",
             "kernels/scoring/rkv.py", "lambda_weight=RKV_LAMBDA,", "lambda_weight=1 - RKV_LAMBDA,",
             tests=SCORING_TESTS),
    Mutation("scoring: random draws the same for every head", "kernels/scoring/random_choice.py",
             "state = (seed & _MASK) ^ ((head << 40) + position)",
             "state = (seed & _MASK) ^ (head * 0 + position)", tests=SCORING_TESTS),
    Mutation("scoring: a request's own policy ignored (the deployment's runs)", "zipage/scoring.py",
             "return default if own is None else own", "return default", tests=SCORING_TESTS),
]

# The CI property tests of the core and the witness traces, run separately so the report says
# what each catches (not the golden logs: a golden diff only says that some decision changed,
# not that a rule broke).
TESTS = {"property tests": "tests/test_core_properties.py",
         "witness traces": "tests/test_preemption_witnesses.py",
         "rule witnesses": "tests/test_core_rules_witnesses.py",
         "fork witnesses": "tests/test_core_forks.py",
         "scoring tests": "tests/test_scoring.py tests/test_scoring_per_request.py",
         "async tests": "tests/test_core_async.py",
         "host tier tests": "tests/test_host_tier.py::test_prompt_blocks_a_compression_rewrites_are_saved_first "
                            "tests/test_host_tier.py::test_the_tier_gives_back_the_prefix_hits_memory_took"}
TIMEOUT_S = 900


def apply(mutation: Mutation, root: Path) -> str | None:
    """Mutate the file under `root`; None if the snippet is not there exactly once."""
    path = root / mutation.path
    text = path.read_text()
    if text.count(mutation.old) != 1:
        return None
    mutated = text.replace(mutation.old, mutation.new)
    path.write_text(mutated)
    return text


def check_snippets() -> list[str]:
    """Names of the mutations whose snippet is not found exactly once in the working tree."""
    missing = []
    for mutation in MUTATIONS:
        text = (ROOT / mutation.path).read_text()
        if text.count(mutation.old) != 1 or mutation.old == mutation.new:
            missing.append(mutation.name)
    return missing


def make_copy(tmp: Path) -> tuple[Path, Path]:
    """Copy the package (laid out as installed, per pyproject's package-dir) and the tests.
    Returns (import root, repository-shaped view for the mutation paths)."""
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())[
        "tool"]["setuptools"]["package-dir"]
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / package_dirs["zipage"], src / "zipage", ignore=ignore)
    view = tmp / "view"  # repository paths -> the copied files, so a mutation path maps 1:1
    view.mkdir()
    (view / "zipage").symlink_to(src / "zipage")
    for package, directory in package_dirs.items():
        if package != "zipage":
            target = src / Path(*package.split("."))
            shutil.copytree(ROOT / directory, target, ignore=ignore)
            (view / directory).symlink_to(target)
    shutil.copytree(ROOT / "tests", tmp / "tests", ignore=ignore)
    (view / "tests").symlink_to(tmp / "tests")
    shutil.copy(ROOT / "pyproject.toml", tmp / "pyproject.toml")
    return src, view


def run_tests(tmp: Path, src: Path, tests: str) -> tuple[bool, str]:
    """Run test files (space-separated) against the copy; (passed, the first failure and why)."""
    env = dict(os.environ, PYTHONPATH=str(src), PYTHONDONTWRITEBYTECODE="1", COLUMNS="250",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
               "-o", "addopts=", "-rfE", "--hypothesis-profile=mutation", *tests.split()]
    try:
        result = subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True,
                                timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False, f"timeout after {TIMEOUT_S} s"
    if result.returncode == 0:
        return True, ""
    lines = [line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    if not lines:
        return False, f"pytest exit {result.returncode}: {result.stdout[-300:]}"
    failure = re.sub(r"^(FAILED|ERROR) tests/", "", lines[0])
    return False, re.sub(r"\s+", " ", failure)[:200]


def assert_imports_from(tmp: Path, src: Path) -> None:
    """The copy, not the working tree, is what the tests import (else 'caught' means nothing)."""
    probe = ("import zipage.core.scheduler as s, zipage.sim.instant as i; "
             "print(s.__file__); print(i.__file__)")
    env = dict(os.environ, PYTHONPATH=str(src), PYTHONDONTWRITEBYTECODE="1")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp, env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    if not all(Path(path).resolve().is_relative_to(src.resolve()) for path in out):
        sys.exit(f"the tests would import {out}, not the copy under {src}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="run only mutations whose name contains one")
    parser.add_argument("--list", action="store_true", help="list the mutations")
    parser.add_argument("--check-snippets", action="store_true",
                        help="only check that every snippet is found exactly once")
    args = parser.parse_args(argv)
    selected = [m for m in MUTATIONS if not args.names or any(n in m.name for n in args.names)]
    if args.list:
        for mutation in selected:
            print(f"{mutation.name}  ({mutation.path})")
        return 0
    missing = set(check_snippets())
    if args.check_snippets:
        for name in missing:
            print(f"not applicable: snippet not found   {name}")
        return 1 if missing else 0

    caught_all = True
    with tempfile.TemporaryDirectory(prefix="zipage-mutation-") as name:
        tmp = Path(name)
        src, view = make_copy(tmp)
        assert_imports_from(tmp, src)
        started = time.perf_counter()
        for label, tests in TESTS.items():
            passed, failure = run_tests(tmp, src, tests)
            if not passed:
                print(f"the unmutated copy fails its {label} ({failure}); fix that first")
                return 2
        print(f"unmutated copy: {' and '.join(TESTS)} pass "
              f"({time.perf_counter() - started:.0f} s)")
        for mutation in selected:
            if mutation.name in missing:
                print(f"not applicable: snippet not found   {mutation.name}")
                caught_all = False
                continue
            started = time.perf_counter()
            original = apply(mutation, view)
            assert original is not None, mutation.name
            try:
                results = {label: run_tests(tmp, src, tests) for label, tests in TESTS.items()
                           if mutation.tests is None or label in mutation.tests}
            finally:
                (view / mutation.path).write_text(original)
            caught = not all(passed for passed, _ in results.values())
            caught_all &= caught
            print(f"{'caught  ' if caught else 'survived'} {mutation.name}  "
                  f"({time.perf_counter() - started:.0f} s)")
            for label in TESTS:
                passed, failure = results.get(label, (None, ""))
                outcome = ("not run (its traces never reach this rule)" if passed is None
                           else "pass" if passed else failure)
                print(f"         {label}: {outcome}", flush=True)
    return 0 if caught_all else 1


if __name__ == "__main__":
    sys.exit(main())
