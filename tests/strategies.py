"""Hypothesis strategies shared by the core and simulator property tests: random feasible
configurations (block size, window, budget, capacity, modes) and random traces (prompt lengths
including 1 and exact block multiples, output lengths including 1, shared-prefix groups and
arrival orders)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from zipage.core.config import ZipageConfig
from zipage.core.sequence import Sequence

MODES = {
    "constrained": dict(compress=True, hybrid=False, prefix_cache=False),
    "constrained_prefix": dict(compress=True, hybrid=False, prefix_cache=True),
    "hybrid": dict(compress=True, hybrid=True, prefix_cache=False),
    "hybrid_prefix": dict(compress=True, hybrid=True, prefix_cache=True),
    "full_kv": dict(compress=False, hybrid=False, prefix_cache=True),
}


@dataclass
class Case:
    config: ZipageConfig
    num_blocks: int
    num_slots: int
    delay: tuple[int, int]
    requests: list[tuple[str, list[int], int, int]]  # id, prompt tokens, output_len, arrival

    def sequences(self) -> list[Sequence]:
        return [Sequence(seq_id, list(tokens), output, arrival_s=arrival)
                for seq_id, tokens, output, arrival in self.requests]


@st.composite
def cases(draw, mode: str) -> Case:
    block_size = draw(st.sampled_from([16, 32]))
    window = draw(st.sampled_from(sorted({1, 2, block_size // 4, block_size // 2})))
    budget = block_size * draw(st.integers(1, 3))
    config = ZipageConfig(
        block_size=block_size, window=window, kv_budget=budget,
        async_compress=draw(st.booleans()),
        max_compress_batch_blocks=draw(st.sampled_from([1, 8, 4096])),
        max_num_seqs=draw(st.sampled_from([2, 512])),
        max_num_batched_tokens=draw(st.sampled_from([4 * block_size, 16384])),
        **MODES[mode],
    )
    n_max = config.n_max
    num_slots = draw(st.integers(1, 4))
    floor = num_slots * n_max if config.compress else 2
    num_blocks = floor + draw(st.integers(0, 12))
    delay_low = draw(st.integers(0, 3))
    delay = (delay_low, delay_low + draw(st.integers(0, 3)))

    b = block_size
    prompt_lengths = st.one_of(
        st.sampled_from([1, b - 1, b, b + 1, 2 * b, 3 * b, n_max * b, n_max * b + b - window]),
        st.integers(1, 4 * b),
    )
    output_lengths = st.one_of(st.sampled_from([1, 2, b, b + 1]), st.integers(1, 6 * b))
    groups = [draw(st.lists(st.integers(100, 999), min_size=4 * b, max_size=4 * b))
              for _ in range(2)]
    requests = []
    for index in range(draw(st.integers(1, 10))):
        length = draw(prompt_lengths)
        group = draw(st.sampled_from([None, 0, 1]))
        if group is None:
            tokens = [10_000 + index * 1_000 + position for position in range(length)]
        else:
            shared = min(length, draw(st.integers(0, 4 * b)))
            tokens = groups[group][:shared] + [
                20_000 + index * 1_000 + position for position in range(length - shared)]
        arrival = draw(st.integers(0, 40))
        requests.append((f"r{index}", tokens, draw(output_lengths), arrival))
    return Case(config, num_blocks, num_slots, delay, requests)
