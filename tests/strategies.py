"""Hypothesis strategies shared by the core and simulator property tests: random feasible
configurations (block size, window, budget, capacity, modes) and random traces (prompt lengths
including 1 and exact block multiples, output lengths including 1, shared-prefix families,
bursts of arrivals).

The draws are weighted so that every mode reaches its rules in a good share of examples
(tests/rule_coverage.py measures it; docs/results/rule-coverage.md has the numbers): memory is
usually tight (the pool barely backs the query slots, so blocks run out and requests are
preempted or blocked), requests arrive in bursts with equal lengths (several need a block in the
same step), prompts often exceed N_max blocks (a prefill leaves a request above the cap), and
with the prefix cache most prompts belong to a family sharing a long prefix, arriving one after
another so the later ones map the earlier ones' blocks (compressions then need fresh targets,
the case that preempts to avoid a deadlock). `mode_seed(mode)` gives each mode its own examples.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import hypothesis_profiles
from hypothesis import seed, settings
from hypothesis import strategies as st

from zipage.config import ZipageConfig
from zipage.core.scheduler import Scheduler
from zipage.core.sequence import Sequence

MODES = {
    "constrained": dict(compress=True, hybrid=False, prefix_cache=False),
    "constrained_prefix": dict(compress=True, hybrid=False, prefix_cache=True),
    "hybrid": dict(compress=True, hybrid=True, prefix_cache=False),
    "hybrid_prefix": dict(compress=True, hybrid=True, prefix_cache=True),
    "full_kv": dict(compress=False, hybrid=False, prefix_cache=True),
    # Compressions never touch the prompt (docs/architecture.md, 'Compression scope').
    "output_scope": dict(compress=True, hybrid=True, prefix_cache=True, compress_scope="output"),
    # Priority classes with aging (docs/architecture.md, 'Waiting-queue policies'): the queue's
    # order, the victim order and the starvation bound (checked at the end of every run).
    "priority": dict(compress=True, hybrid=True, prefix_cache=True, scheduling_policy="priority"),
    "priority_full_kv": dict(compress=False, hybrid=False, prefix_cache=True,
                             scheduling_policy="priority"),
    # A host tier of a few slots behind the prefix cache (docs/architecture.md, 'Host tier'):
    # saves of dropped prompt blocks, loads of prefix hits, slots reused within a step.
    "host_tier": dict(compress=True, hybrid=True, prefix_cache=True),
    "host_tier_full_kv": dict(compress=False, hybrid=False, prefix_cache=True),
}
HOST_MODES = ("host_tier", "host_tier_full_kv")


def mode_seed(mode: str):
    """A decorator giving each mode its own examples.

    Under a derandomized profile (ci), or a run given --hypothesis-seed, hypothesis seeds from the
    test function (and that seed), which the parametrized tests share, so every mode would replay
    the same draws; a random run without a seed draws afresh for each anyway.
    """
    if not settings().derandomize and hypothesis_profiles.run_seed is None:
        return lambda test: test
    return seed(zlib.crc32(mode.encode()) ^ (hypothesis_profiles.run_seed or 0))


@dataclass
class Case:
    config: ZipageConfig
    num_blocks: int
    num_slots: int
    delay: tuple[int, int]
    requests: list[tuple[str, list[int], int, int]]  # id, prompt tokens, output_len, arrival
    shape: str = "spread"  # which trace shape drew it (see SHAPES)
    priorities: list[int] | None = None  # each request's class (the priority modes)
    num_host_blocks: int = 0  # the host tier's slots (the host modes)

    def new_scheduler(self, config: ZipageConfig | None = None) -> Scheduler:
        return Scheduler(config or self.config, self.num_blocks, self.num_slots,
                         self.num_host_blocks)

    def sequences(self) -> list[Sequence]:
        sequences = [Sequence(seq_id, list(tokens), output, arrival_s=arrival)
                     for seq_id, tokens, output, arrival in self.requests]
        for seq, priority in zip(sequences, self.priorities or ()):
            seq.priority = priority
        return sequences


# Trace shapes. "spread": independent requests over 40 steps, the generic case. "crowd": three to
# ten requests arrive within two steps, many twins (equal lengths: they need a block in the same
# step), on a pool sized to what the first of them hold after their prefill: blocks run out
# (preemption; blocking under constrained scheduling), slots run out, requests without a slot
# wait for one. "family" (prefix cache): requests sharing a long prompt prefix, most arriving one
# or two steps apart so each maps the blocks of the ones before; their compressions need fresh
# targets, which on a tight pool takes a preemption (the prefix-cache deadlock case).
SHAPES = {
    "full_kv": ["spread", "crowd", "crowd"],
    "constrained": ["spread", "crowd", "crowd"],
    "hybrid": ["spread", "crowd", "crowd"],
    "constrained_prefix": ["spread", "crowd", "family", "family", "family"],
    "hybrid_prefix": ["spread", "crowd", "crowd", "family", "family", "family"],
    "output_scope": ["spread", "crowd", "family", "family"],
    "priority": ["spread", "crowd", "crowd", "family"],
    "priority_full_kv": ["spread", "crowd", "crowd"],
    "host_tier": ["spread", "crowd", "family", "family"],
    "host_tier_full_kv": ["spread", "crowd", "family", "family"],
}


@st.composite
def cases(draw, mode: str) -> Case:
    shape = draw(st.sampled_from(SHAPES[mode]))
    block_size = draw(st.sampled_from([16, 32]))
    window = draw(st.sampled_from(sorted({1, 2, block_size // 4, block_size // 2})))
    budget = block_size * draw(st.integers(1, 3))
    config = ZipageConfig(
        block_size=block_size, window=window, kv_budget=budget,
        async_compress=draw(st.booleans()),
        max_compress_batch_blocks=draw(st.sampled_from([1, 8, 4096])),
        max_num_seqs=draw(st.sampled_from([2, 512] if shape == "spread" else [512])),
        # A small step budget also rejects the longest prompts (they must fail alone).
        max_num_batched_tokens=draw(st.sampled_from(
            [4 * block_size, 16384] if shape == "spread" else [16384])),
        **MODES[mode],
        # Short aging lets late requests of a low class overtake, long aging lets classes rule
        # (drawn only where it matters: the other modes keep their examples).
        **({"priority_aging_s": draw(st.sampled_from([0.5, 3.0, 1000.0]))}
           if MODES[mode].get("scheduling_policy") == "priority" else {}),
    )
    n_max = config.n_max
    num_slots = draw(st.integers(1, 4) if shape == "spread" else st.integers(2, 4))
    delay_low = draw(st.integers(0, 3))
    delay = (delay_low, delay_low + draw(st.integers(0, 3)))
    b = block_size
    if shape == "spread":
        requests = draw(_spread(config))
    else:
        requests = draw((_family if shape == "family" else _crowd)(config, num_slots))
    floor = num_slots * n_max if config.compress else 2
    if shape == "spread":
        num_blocks = floor + draw(st.integers(0, 12))
    else:
        # Just what the first requests to arrive hold after their prefill (shared prompt blocks
        # once): the slot holders, a few more without a slot (hybrid), two to four (Full KV).
        first = sorted(requests, key=lambda request: request[3])
        if not config.compress:
            count = draw(st.integers(2, 4))
        else:
            more = config.hybrid and shape == "crowd"
            count = num_slots + (draw(st.integers(0, 2)) if more else 0)
        num_blocks = max(floor, _distinct_blocks(first[:count], b)) + draw(st.integers(0, 1))
    priorities = None
    if config.scheduling_policy == "priority":
        priorities = draw(st.lists(st.integers(-1, 3), min_size=len(requests),
                                   max_size=len(requests)))
    # One slot reuses itself within a step; a few make the tier evict and reload.
    host_blocks = draw(st.integers(1, 6)) if mode in HOST_MODES else 0
    return Case(config, num_blocks, num_slots, delay, requests, shape, priorities, host_blocks)


def _distinct_blocks(requests: list, block_size: int) -> int:
    """Blocks the prompts of `requests` take together, a shared full block counted once."""
    blocks = set()
    for seq_id, tokens, _, _ in requests:
        for start in range(0, len(tokens), block_size):
            end = start + block_size
            blocks.add(tuple(tokens[:end]) if end <= len(tokens) else (seq_id, start))
    return len(blocks)


def _prefix(group: int, length: int) -> list[int]:
    """The shared prompt prefix of a group. Only equality of token blocks matters to the
    scheduler, so the ids are fixed (drawing them would only cost generation time)."""
    return [100_000 * (group + 1) + position for position in range(length)]


def _tokens(index: int, length: int, prefix: list[int], shared: int) -> list[int]:
    """A prompt of `length` tokens: the first `shared` of `prefix`, then its own tokens."""
    shared = min(shared, length)
    return prefix[:shared] + [20_000 + index * 1_000 + position
                              for position in range(length - shared)]


@st.composite
def _spread(draw, config: ZipageConfig) -> list:
    b, n_max, window = config.block_size, config.n_max, config.window
    prompt_lengths = st.one_of(
        st.sampled_from([1, b - 1, b, b + 1, 2 * b, 3 * b, n_max * b, n_max * b + b - window]),
        st.integers(1, 4 * b),
    )
    output_lengths = st.one_of(st.sampled_from([1, 2, b, b + 1]), st.integers(1, 6 * b))
    groups = [_prefix(group, 4 * b) for group in range(2)]
    requests = []
    for index in range(draw(st.integers(1, 10))):
        length = draw(prompt_lengths)
        group = draw(st.sampled_from([None, 0, 1]))
        shared = 0 if group is None else draw(st.integers(0, 4 * b))
        tokens = _tokens(index, length, groups[group or 0], shared)
        requests.append((f"r{index}", tokens, draw(output_lengths), draw(st.integers(0, 40))))
    return requests


def _prompt_lengths(config: ZipageConfig):
    """Short prompts (a hybrid scheduler admits them without a slot), prompts near the cap and
    prompts above it (they hold extra blocks until their first compression); most end on or just
    past a block boundary, so they need their next block within a block of decoding."""
    b, n_max = config.block_size, config.n_max
    return st.one_of(
        st.integers(1, max(1, (n_max - 1) * b - config.window)),
        st.builds(lambda blocks, offset: max(1, blocks * b + offset),
                  st.integers(0, 2 * n_max), st.integers(0, 3)),
    )


def _output_lengths(config: ZipageConfig):
    """Mostly long enough to fill a few blocks (hypothesis favours the small end of a range)."""
    b = config.block_size
    return st.one_of(st.integers(2 * b, 6 * b), st.integers(1, 6 * b))


@st.composite
def _crowd(draw, config: ZipageConfig, num_slots: int) -> list:
    b, n_max = config.block_size, config.n_max
    prompt_lengths, output_lengths = _prompt_lengths(config), _output_lengths(config)
    count = draw(st.integers(3, 10))
    # Half the crowds start with a hog: a prompt above the cap, one token into a block, that
    # holds its extra blocks for almost a block of decoding while the others need theirs.
    hog = int(draw(st.booleans()))  # the index of the first request that may get a twin
    requests = []
    for index in range(count):
        if index < hog:
            length = (n_max + draw(st.integers(1, n_max))) * b + 1
            output, arrival = draw(output_lengths), 0
        elif index > hog and draw(st.booleans()):
            _, tokens, output, arrival = requests[-1]  # a twin: the same lengths and arrival
            length = len(tokens)
        else:
            length, output = draw(prompt_lengths), draw(output_lengths)
            arrival = draw(st.integers(0, 2))
        requests.append((f"r{index}", _tokens(index, length, [], 0), output, arrival))
    return requests


@st.composite
def _family(draw, config: ZipageConfig, num_slots: int) -> list:
    b, n_max = config.block_size, config.n_max
    prompt_lengths, output_lengths = _prompt_lengths(config), _output_lengths(config)
    prefix = _prefix(0, 2 * n_max * b)
    # Often no more members than slots: the last one admitted is then also the last running.
    count = draw(st.one_of(st.integers(2, num_slots + 1), st.integers(3, 10)))
    # A late compressor: the last slot holder, a prompt of N_max or more whole blocks. Admitted
    # after the others, it compresses at its first decode, before them, so when their
    # compressions need fresh blocks the prefix-cache rule must skip it to find a victim.
    late = min(count, num_slots) - 1 if draw(st.integers(0, 2)) else None
    requests = []
    arrival = 0
    for index in range(count):
        if index == late:
            length = (n_max + draw(st.sampled_from([0, 0, 0, 1]))) * b
            output = draw(output_lengths)
        elif requests and draw(st.integers(0, 9)) < 7:
            # A twin one step later: prefill steps stop decoding, so it keeps lockstep with the
            # one before and their compressions need fresh blocks in the same step.
            _, tokens, output, _ = requests[-1]
            length = max(b + 1, len(tokens))
        else:
            length, output = max(b + 1, draw(prompt_lengths)), draw(output_lengths)
        arrival += draw(st.sampled_from([1, 1, 1, 0, 2]))  # mostly after the one before's prefill
        if index == late and draw(st.booleans()):
            shared = 0
        else:
            shared = draw(st.one_of(st.just(length), st.integers(b, length)))
        requests.append((f"r{index}", _tokens(index, length, prefix, shared), output, arrival))
    return requests
