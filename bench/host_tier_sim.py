"""What a host-memory tier for prefix-cache blocks could give back (issue #45): an upper bound, in the
simulator, before the tier is built.

Under `--compress-scope all` a compression rewrites a request's own prompt blocks, and under any
scope the allocator reuses free blocks whose content the prefix index still maps; either way the
next turn of a session finds its prefix gone and computes it again. A host tier would copy such a
block to host memory before it is overwritten and copy it back on a later hit. This script runs
the simulator with the block manager watched (the product's code is not changed: the methods are
wrapped here): every hash the GPU index drops goes into a host LRU of `--host-gb` (least recently
used out first), and every prefix lookup that stops on the GPU is continued through the LRU. It
prints, per trace and scope, the prompt tokens found on the GPU (what the run had) and the tokens
the host tier would add, against Full KV's hits, with the bytes to copy back.

An upper bound: the run's timing is the run without the tier (a hit on the host would skip a
prefill and move every later step), and copies are free here (the H200's host link, ~50 GB/s a
direction, moves a 9.4 MB Qwen3-8B block of 64 tokens in ~0.2 ms; a prefill of the same block
costs ~1.3 ms). What it answers is whether the tier is worth building: how much of `all`'s lost
prefix it would recover, at which host memory.

    zipage trace make agent-sessions --sessions 12 --scale 0.1 --tool-time 0.1 --think-time 0.5 \\
        --session-rate 4 -o agent.jsonl
    python bench/host_tier_sim.py agent.jsonl [chat.jsonl ...] [--host-gb 8,32,128]
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

from zipage.config import ZipageConfig
from zipage.core.block_manager import BlockManager
from zipage.core.deployment import ReplaySettings
from zipage.core.memory import kv_entry_bytes
from zipage.presets import get_preset
from zipage.sim.simulate import simulate
from zipage.trace_import import load_trace_file

PROFILES = Path(__file__).resolve().parent.parent / "sim" / "profiles"


class HostTier:
    """The LRU of block hashes a host tier of `capacity` blocks would hold, and what it found."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.found: dict[str, int] = {}  # seq_id -> prompt blocks found on the host, last lookup

    def save(self, block_hash: int) -> None:
        if self.capacity <= 0:
            return
        self.blocks[block_hash] = None
        self.blocks.move_to_end(block_hash)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)

    def continue_lookup(self, seq_id: str, hashes: list[int], gpu_hits: int) -> None:
        found = 0
        for block_hash in hashes[gpu_hits:]:
            if block_hash not in self.blocks:
                break
            self.blocks.move_to_end(block_hash)
            found += 1
        self.found[seq_id] = found


@contextmanager
def watched(tier: HostTier):
    """BlockManager with every dropped hash saved to `tier` and every prefix lookup continued
    through it (wrapping `allocate_many`, `_forget_hash` and `cached_prefix_blocks`)."""
    allocate_many, forget_hash = BlockManager.allocate_many, BlockManager._forget_hash
    cached_prefix_blocks = BlockManager.cached_prefix_blocks

    def allocate(self, count):
        # A block handed out loses its content, and with it the hash the index mapped to it.
        before = list(self.block_hash)
        blocks = allocate_many(self, count)
        for block in blocks:
            if before[block] is not None:
                tier.save(before[block])
        return blocks

    def forget(self, block):
        if self.block_hash[block] is not None:
            tier.save(self.block_hash[block])
        forget_hash(self, block)

    def lookup(self, seq, num_tokens):
        hits = cached_prefix_blocks(self, seq, num_tokens)
        if self.prefix_cache and not seq.prompt_logits:
            limit = (num_tokens - 1) // self.block_size
            tier.continue_lookup(seq.seq_id, seq.prompt_block_hashes[:limit], len(hits))
        return hits

    with mock.patch.object(BlockManager, "allocate_many", allocate), \
            mock.patch.object(BlockManager, "_forget_hash", forget), \
            mock.patch.object(BlockManager, "cached_prefix_blocks", lookup):
        yield


def kv_bytes_per_token(model: str) -> int:
    """K and V of every layer and KV head, in bf16: what a block copies (its global scores stay)."""
    shape = get_preset(model)
    return 2 * shape.num_layers * shape.num_kv_heads * kv_entry_bytes(shape.head_dim, "auto", 2)


def run(trace_path: str, scope: str | None, host_gb: float, args) -> dict:
    token_bytes = kv_bytes_per_token(args.model)
    block_bytes = args.block_size * token_bytes
    tier = HostTier(int(host_gb * 1e9 // block_bytes))
    compress = scope is not None
    config = ZipageConfig(block_size=args.block_size, kv_budget=args.budget, compress=compress,
                          **({"compress_scope": scope} if compress else {}))
    mode = "zipage" if compress else "fullkv"
    settings = ReplaySettings(model=args.model, hardware=args.hardware,
                              kv_memory_gb=args.kv_memory_gb, config=config,
                              cost_model=str(PROFILES / f"{args.profile}-{mode}.json"))
    with watched(tier):
        summary, _ = simulate(load_trace_file(trace_path), settings)
    host_tokens = sum(tier.found.values()) * args.block_size
    return {"gpu": summary["prefix_hit_tokens"], "host": host_tokens,
            "copy_gb": host_tokens * token_bytes / 1e9,
            "makespan": summary["makespan_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--host-gb", default="8,32,128")
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--hardware", default="h200")
    parser.add_argument("--profile", default="qwen3-8b-h200-b64-k512")
    parser.add_argument("--kv-memory-gb", type=float, default=6.0)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--link-gbps", type=float, default=50.0,
                        help="host-to-GPU copy bandwidth, GB/s (H200 on PCIe 5: ~50)")
    args = parser.parse_args()
    sizes = [float(size) for size in args.host_gb.split(",")]
    print("| trace | scope | host GB | GPU prefix-hit tokens | + host tier | vs Full KV's hits | "
          "copied back GB | copies, share of makespan |")
    print("|---|---|---|---|---|---|---|---|")
    for trace in args.traces:
        name = Path(trace).name.split(".")[0]
        full = run(trace, None, 0.0, args)
        print(f"| {name} | Full KV | - | {full['gpu']:,} | | 100.0 % | |")
        for scope in ("all", "output"):
            for size in sizes:
                row = run(trace, scope, size, args)
                total = row["gpu"] + row["host"]
                print(f"| {name} | {scope} | {size:g} | {row['gpu']:,} "
                      f"({row['gpu'] / max(full['gpu'], 1):.1%}) | {total:,} | "
                      f"{total / max(full['gpu'], 1):.1%} | {row['copy_gb']:.1f} | "
                      f"{row['copy_gb'] / args.link_gbps / row['makespan']:.2%} |")


if __name__ == "__main__":
    main()
