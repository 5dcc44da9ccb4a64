"""Admission's pure rules: whether a request can ever be served by a deployment, and its N_max.

They read only the knobs and the pool's size, never the queues, so the scheduler asks them when a
request arrives and the server asks them before it sends a request to its engine process, without
building a scheduler (`Admission(config, num_blocks)`). `prepare` fixes what follows from them
for a request the scheduler queues. What may start *now* (blocks, slots, the head of the waiting
queue) is the scheduler's question (docs/architecture.md, 'Scheduling').
"""

from __future__ import annotations

from dataclasses import dataclass

from zipage import request_fields
from zipage.config import ZipageConfig, budget_violation
from zipage.core.block_manager import prompt_block_hashes
from zipage.core.sequence import Sequence
from zipage.scoring import SCORING_POLICIES

# The field a refusal names when the request's lengths, not one of its fields, are at fault.
PROMPT = "prompt"


@dataclass(frozen=True)
class Refusal:
    """Why a request can never be served here: `field`, the request field at fault (a name of
    zipage/request_fields.py, or PROMPT when its lengths are), and `why`, what is wrong and the
    fix, without the field's name: each reader words the pair its own way (the core's log and
    requests.csv below; the server's 400, its `param` the field)."""

    field: str
    why: str

    def text(self) -> str:
        return self.why if self.field == PROMPT else f"{self.field} {self.why}"


class Admission:
    def __init__(self, config: ZipageConfig, num_blocks: int) -> None:
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = config.block_size
        self.compress = config.compress
        self.n_max = config.n_max  # of the default budget
        # Resolved once: `step_tokens` is a property of the (frozen) config.
        self.step_tokens = config.step_tokens
        # docs/architecture.md, 'Compression scope': the default keeps every prompt whole.
        self.pins_prompts = config.compress and config.compress_scope == "output"
        self.by_priority = config.scheduling_policy == "priority"
        # The policies a request may not ask for here: those that would keep a global score per
        # entry (the pipeline under --global-score) when the deployment's own policy keeps none,
        # so no score cache was allocated (`ZipageConfig.keeps_global_scores`). Running them
        # without it would be another policy than the one asked for, so they are refused.
        self.unallocated_scorings = frozenset(
            name for name, spec in SCORING_POLICIES.items()
            if config.compress and config.global_score and spec.global_scores
            and not config.keeps_global_scores)

    def rejection_reason(self, seq: Sequence) -> str | None:
        """Why `seq` can never be served here, in words ("request <id>: ..."), or None."""
        refusal = self.refusal(seq)
        return None if refusal is None else f"request {seq.seq_id}: {refusal.text()}"

    def refusal(self, seq: Sequence) -> Refusal | None:
        """Why `seq` can never be served here, or None. O(1) from its lengths alone, so a driver
        can ask before building a prompt it would throw away (a 10^9-token one)."""
        prompt, output = seq.prompt_len, seq.max_output_tokens
        if prompt < 1 or output < 1:
            return Refusal(PROMPT, f"prompt_len and output_len must be >= 1 (got {prompt}, "
                                   f"{output})")
        if seq.priority and not self.by_priority:
            return Refusal("priority", self.priority_reason(seq.priority))
        if seq.scoring is not None:  # its own policy (most requests bring none)
            scoring_reason = self.scoring_reason(seq.scoring)
            if scoring_reason is not None:
                return Refusal("scoring", scoring_reason)
        n_max = None  # the default budget's
        if seq.kv_budget is not None:  # its own budget (most requests bring none)
            budget_reason = self.budget_reason(seq.kv_budget)
            if budget_reason is not None:
                return Refusal("kv_budget", budget_reason)
            n_max = self.n_max_of(seq)
        elif self.pins_prompts or seq.compress_scope is not None:
            n_max = self.n_max_of(seq)  # its prompt's blocks besides the budget's
        limit = self.config.max_model_len
        if limit is not None and prompt + output > limit:
            return Refusal(PROMPT, f"prompt_len + output_len = {prompt + output} exceeds "
                                   f"max_model_len {limit}; shorten the request or raise "
                                   "--max-model-len")
        if not self.config.chunked_prefill and prompt > self.step_tokens:
            return Refusal(PROMPT, f"prompt_len {prompt} exceeds max_num_batched_tokens "
                                   f"{self.step_tokens}; raise --max-num-batched-tokens or turn "
                                   "chunked prefill back on (--chunked-prefill)")
        peak = self.peak_blocks(prompt, output, n_max)
        if peak > self.num_blocks:
            return Refusal(PROMPT, f"needs {peak} KV blocks at its peak but only "
                                   f"{self.num_blocks} exist; give more KV memory"
                                   + (" or enable compression" if not self.compress else ""))
        return None

    def prepare(self, seq: Sequence) -> None:
        """Fix, for a request about to be queued, what it keeps from here on: its prompt blocks'
        hashes (prefix cache), its budget, N_max, pinned blocks and the blocks its query slot
        reserves."""
        # A driver may give the blocks' hashes itself (the simulator's keys); a prompt shorter
        # than a block has none to give.
        if (self.config.prefix_cache and not seq.prompt_block_hashes
                and seq.prompt_len >= self.block_size):
            if seq.prompt_token_ids is None:
                raise ValueError(f"request {seq.seq_id}: prefix caching needs prompt_token_ids")
            seq.prompt_block_hashes = prompt_block_hashes(seq.prompt_token_ids, self.block_size)
        if seq.kv_budget is None:
            seq.kv_budget = self.config.kv_budget
        seq.n_max = self.n_max_of(seq)
        seq.pinned = self.pinned_of(seq) if self.compress else 0
        # Blocks a query slot reserves for its holder: its N_max, or all it can ever hold if
        # fewer. The holders' reservations never exceed the pool, which is what keeps any mix
        # of budgets deadlock-free (docs/architecture.md, 'Deadlock freedom'). Fixed from here
        # on, so worked out once (slots are taken and given back several times a request).
        whole = -(-(seq.prompt_len + seq.max_output_tokens - 1) // self.block_size)
        seq.slot_blocks = seq.n_max if seq.n_max < whole else whole  # (min, written out)

    def budget_reason(self, kv_budget: int | None) -> str | None:
        """Why a request's own `kv_budget` is refused here (without the field's name), or None
        (None means the default)."""
        if kv_budget is None:
            return None
        expected = budget_violation(self.block_size, kv_budget)
        if expected is None:
            return None
        b = self.block_size
        near = max(b, kv_budget // b * b) if isinstance(kv_budget, int) else self.config.kv_budget
        return (f"{kv_budget!r} must be {expected} (N_max = kv_budget / "
                f"{b} + 1 >= 2 blocks); use e.g. {near}, or leave it out for the default "
                f"{self.config.kv_budget}")

    def priority_reason(self, priority: int) -> str | None:
        """Why a request's `priority` is refused here (without the field's name), or None: a class
        other than 0 needs the priority policy (vLLM's rule: a priority the deployment would
        ignore is an error)."""
        if not priority or self.by_priority:
            return None
        return (f"{priority} needs --scheduling-policy priority (this deployment serves "
                "in arrival order); leave priority out, or serve with --scheduling-policy "
                "priority")

    def scoring_reason(self, scoring: str | None) -> str | None:
        """Why a request's own `scoring` is refused here (without the field's name), or None (None
        means the deployment's): a name the registry does not know, or a policy that needs a
        global score cache this deployment did not allocate (docs/compression.md, 'Scoring
        policies')."""
        if scoring is None:
            return None
        if scoring not in SCORING_POLICIES:
            return request_fields.BY_NAME["scoring"].rule_broken(scoring)
        if scoring not in self.unallocated_scorings:
            return None
        usable = ", ".join(name for name in SCORING_POLICIES
                           if name not in self.unallocated_scorings)
        return (f"{scoring!r} keeps a global score per KV entry, but this deployment "
                f"(--scoring {self.config.scoring}) allocated no score cache; ask for one of "
                f"{usable}, leave scoring out, or serve with --scoring {scoring}")

    def n_max_of(self, seq: Sequence) -> int:
        """The request's N_max: its own budget's, or the default's (checked by `budget_reason`),
        plus the blocks its compressions never touch (`pinned_of`)."""
        budget = self.config.kv_budget if seq.kv_budget is None else seq.kv_budget
        return budget // self.block_size + 1 + self.pinned_of(seq)

    def pinned_of(self, seq: Sequence) -> int:
        """Leading blocks no compression of `seq` touches: its whole prompt when its scope is
        "output" (docs/architecture.md, 'Compression scope'), else none."""
        scope = self.config.compress_scope if seq.compress_scope is None else seq.compress_scope
        return -(-seq.prompt_len // self.block_size) if scope == "output" else 0

    def peak_blocks(self, prompt_len: int, output_len: int, n_max: int | None = None) -> int:
        """Most blocks a request must hold at once when it runs alone.

        All its KV (prompt + output - 1 entries: the last token is never cached) under Full KV;
        with compression it stops growing at max(prompt blocks, N_max) (the request's own N_max;
        an elastic request grows past it only while blocks are spare, so this is its need).
        """
        whole = -(-(prompt_len + output_len - 1) // self.block_size)
        if not self.compress:
            return whole
        n_max = self.n_max if n_max is None else n_max
        # min(whole, max(prompt blocks, n_max)), written out: twice a request, and a call of
        # the builtin min or max costs ten comparisons.
        cap = -(-prompt_len // self.block_size)
        if n_max > cap:
            cap = n_max
        return whole if whole < cap else cap
