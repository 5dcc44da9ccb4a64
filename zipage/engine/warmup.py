"""Warm-up: run every kind of step once before the clock starts.

The first prefill and the first compression of a process compile their Triton kernels (seconds on
a cold cache), and the first launches allocate the allocator's pools. Left to the first requests,
that lands in their time to first token: a fresh engine served a RAG-like trace with a TTFT p90
of 0.8 s where the same engine, warm, took 0.07 s. `warm_up` runs a prefill, a decode and (with
compression on) a synchronous compression on scratch requests placed directly in the caches, then
leaves the caches as they were in every way that matters: a run allocates its blocks fresh and a
request's first compression never reads the score cache of earlier occupants. Under async
scheduling the prefill and the decode go through `launch`, the decode's token fed on the device, as
every step after a run's first is. On a GPU the LM head then runs once for every row count it sees
outside a graph: cuBLAS's first matmul of a shape waits for the device to be idle, which cost the
async engine its first steps' overlap.
"""

from __future__ import annotations

import torch

from zipage.core.sampling import SamplingParams
from zipage.core.sequence import Sequence
from zipage.core.step import DECODE, PREFILL, CompressionJob, PrefillItem, StepPlan
from zipage.engine.runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


def warm_up(runner: ModelRunner, num_blocks: int) -> None:
    """One prefill, one decode and one compression on blocks [0, n) of an unused cache.
    `runner` may be a `TensorParallelExecutor` (same interface): every rank warms up."""
    config = runner.config
    b = config.block_size
    # A compression needs N_max full source blocks plus the block of the token being decoded;
    # no request is wider than max_model_len (the graphs' block tables are not), so where that
    # is narrower no request can ever compress and the warm-up compresses nothing either.
    blocks = min(num_blocks, config.n_max + 1 if config.compress else 2)
    if config.max_model_len is not None:
        blocks = min(blocks, -(-config.max_model_len // b))
    tokens = max(1, (blocks - 1) * b)
    seq = Sequence("warm-up", [0] * tokens, 2, sampling=GREEDY)
    seq.block_table = list(range(blocks))
    seq.query_slot = 0 if config.compress else None
    history = {seq.seq_id: [0] * tokens}
    prefill = StepPlan(step_id=-2, kind=PREFILL, prefill=[PrefillItem(seq, 0, tokens)])
    decode = StepPlan(step_id=-1, kind=DECODE, decode=[seq])
    if config.async_scheduling and isinstance(runner, ModelRunner):
        # The async path's own first use: its pinned staging buffers, and the kernels that feed
        # a decode row the token sampled on the device (the first measured step paid them).
        launched = runner.launch(prefill, history)
        seq.set_counters(tokens, 1)
        runner.launch(decode, history, launched).tokens()
        history[seq.seq_id].append(0)
    else:
        runner.execute(prefill, history)
        seq.set_counters(tokens, 1)
        history[seq.seq_id].append(0)
        runner.execute(decode, history)
    if runner.compressor is not None and blocks > config.n_max:
        source = seq.block_table[:config.n_max]
        runner.compressor.run([CompressionJob(
            seq=seq, source_table=source, target_blocks=source[:config.n_max - 1],
            new_block=source[config.n_max - 1], released=[], query_slot=0, is_first=True)])
    if runner.device.type == "cuda":
        runner.warm_logits()
        torch.cuda.synchronize(runner.device)
