"""The model runner: KV cache memory, per-step batch layout, CUDA graphs and sampling.

The runner turns one `StepPlan` into tensors, runs the model and samples one token per request
that samples (`StepPlan.sampled`) with each request's own `SamplingParams` (`seq.sampling`). It
allocates the caches (`engine/caches.py`) and gives each attention layer views of them; the
compressor gets the caches, not the runner.
Decode steps replay CUDA graphs captured for a ladder of batch sizes (eager above the largest);
prefill and mixed steps run through a padded layout and graphs per token bucket (below) when
prefill graphs are on (`prefill_graphs=True`; `build_engine` turns them on wherever decode
graphs are captured, the CLI's `--no-prefill-graphs` off), eagerly otherwise. On the CPU the
same code runs the torch reference kernels.

Mixed steps (chunked prefill: decodes and prompt chunks in one plan) run as ONE forward. The
rows are every chunk's new tokens, sequence after sequence, then one row per decode request;
the linear layers, norms and RoPE run once over all of them, and each layer stores every row's
K/V before any attention reads the cache (so a chunk, or a prefix-cache hit on blocks another
item of the same step computes, sees them). Attention is then two kernels in the same layer:
the varlen prefill kernel over the chunk rows and the split-K decode kernel over the decode
rows, not one varlen kernel with the decodes as 1-token sequences. The prefill kernel gives one
program to each (sequence, query tile, KV head) and walks that sequence's whole context
serially; the decode kernel cuts each context into partitions sized from the decode batch so a
few long decodes still fill the GPU. A mixed step of a chunk and, say, 4 decodes at 32k context
would through one varlen kernel spend 4 x kv_heads programs walking 32k entries each (a few SMs
busy, the rest idle) — far slower than the decode step alone. Two launches keep a mixed step
at about decode attention + chunk attention, and each kernel stays the one already tuned for its
shape. Logits are computed only for the rows that sample: each sampling chunk's last row, then
every decode row (a partial chunk computes KV only), in `StepPlan.sampled` order.

Prefill graphs. An eager prefill step is host-bound (~400 launches at ~60-70 us of Python and
launcher time each on an H200, against 5-11 ms of kernels for 128-512 tokens). A step of at most
`PREFILL_GRAPH_TOKENS[-1]` rows is therefore staged into static tensors padded to its bucket (the
next size of the ladder in zipage/prefill_buckets.py): rows (padding rows store nothing),
sequences (padding sequences are empty), a block table of the widest shape and a fixed-size work
list for the prefill kernel; the decode rows of a mixed step become sequences of one new token in
the same prefill launch, because a graph's grid cannot depend on how many rows decode. They lose the
decode kernel's split-K there, so a few rows of long context make a serial tail (15 ms of a
Llama-3.1-8B step beside 16 rows at 20k entries on an H200). Each bucket therefore has a second
graph, with a decode section: a fixed number of slots whose rows go through the split-K decode kernel
after the prefill launch, empty slots with no entries; a step of a few decode rows of long context
(`takes_decode_section`, zipage/prefill_buckets.py) fills its first slots and gives its decode rows
no prefill work item (docs/cost_model.md, 'The decode section'). Each bucket's graph replays that
padded forward up to the last hidden states; the logits of the rows that sample follow eagerly
(one gather and one matmul of the right size). The same forward runs eagerly where no graph was
captured (the CPU and its tests), so turning graphs on changes nothing but the launches. Larger
steps run eagerly.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

import numpy as np
import torch

from zipage.config import ZipageConfig
from zipage.core.memory import MemoryPlan
from zipage.core.sequence import Sequence
from zipage.core.step import StepPlan
from zipage.core.window import WindowLayout
from zipage.decode_grid import GRAPH_BATCH_SIZES, decode_grid_partitions, programs_per_sm, takes_balanced_split
from zipage.engine.caches import KVCaches
from zipage.engine.compressor import Compressor
from zipage.engine.context import DecodeSection, ForwardContext, forward_context
from zipage.engine.host_kv import HostKV
from zipage.engine.host_tables import HostTables
from zipage.engine.sampler import sample, token_logprobs
from zipage.engine.structured import StructuredOutputs
from zipage.kernels.attention import PrefillWork, prefill_tile_tokens, prefill_work, prefill_work_capacity
from zipage.prefill_buckets import (
    DECODE_SECTION_GRID_BATCH,
    bucket_of,
    buckets_up_to,
    decode_section_rows,
    takes_decode_section,
)
from zipage.shape import ModelShape


@dataclass
class Launched:
    """A step whose forward and sampling are queued on the device (`ModelRunner.launch`): the
    requests that sample, in `StepPlan.sampled` order, their token ids on the device, and the
    copy of those ids to the host, done when `ready` has happened."""

    sequences: list[Sequence]
    sampled: torch.Tensor | None
    host: torch.Tensor | None
    ready: torch.cuda.Event | None

    def tokens(self) -> list[tuple[Sequence, int]]:
        """(request, sampled token) for each request that sampled; waits for the step."""
        if self.host is None:
            return []
        if self.ready is not None:
            self.ready.synchronize()
        return list(zip(self.sequences, self.host.tolist()))


@dataclass
class StepInputs:
    """Host tensors of one prefill or mixed step (`ModelRunner.step_inputs`).

    Rows: the new tokens of every prompt chunk (sequence i owns rows cu_seqlens_q[i] ..
    cu_seqlens_q[i + 1] - 1), then one row per decode request. `logits_indices` are the rows that
    sample a token, in `StepPlan.sampled` order: each sampling chunk's last row, then the decode
    rows. The decode fields are None in a step without decodes.
    """

    input_ids: torch.Tensor  # int64 [rows]
    positions: torch.Tensor  # int64 [rows]
    slot_mapping: torch.Tensor  # int64 [rows], -1 = store nothing
    query_slot_mapping: torch.Tensor  # int64 [rows], -1 = no window query
    cu_seqlens_q: torch.Tensor  # int32 [chunks + 1]
    context_lens: torch.Tensor  # int32 [chunks]
    block_tables: torch.Tensor  # int32 [chunks, width]
    decode_context_lens: torch.Tensor | None  # int32 [decodes]
    decode_block_tables: torch.Tensor | None  # int32 [decodes, width]
    logits_indices: torch.Tensor  # int64 [sampled + prompt rows]
    max_q_len: int
    # Chunks that want their prompt's logits (`PrefillItem.prompt_logits`): (request id, first
    # KV entry, rows), their rows at the end of `logits_indices`, after the sampling rows.
    prompt_rows: list[tuple[str, int, int]] | None = None


class ModelRunner:
    def __init__(self, model: torch.nn.Module, shape: ModelShape, config: ZipageConfig,
                 capacity: MemoryPlan, dtype: torch.dtype, device: torch.device,
                 cuda_graphs: bool = True, prefill_graphs: bool = False) -> None:
        self.model = model
        self.shape = shape
        self.config = config
        self.block_size = config.block_size
        self.windows = WindowLayout(config.block_size, config.window)
        self.host_tables = HostTables()  # decode steps' block tables, converted once per change
        self.dtype = dtype
        self.device = device
        self.caches = KVCaches.allocate(shape, capacity, config, dtype, device)
        self.kv_cache = self.caches.kv
        self.query_cache = self.caches.query
        self.score_cache = self.caches.score
        # Steps run on a stream of the highest priority: while an async compression batch fills
        # the GPU from the compressor's (default-priority) stream, the block scheduler hands
        # freed SMs to the decode first, so the decode is not queued behind the compression.
        self.stream = (torch.cuda.Stream(device, priority=-5) if device.type == "cuda"
                       else None)
        # Copy a step's host inputs through pinned memory: a copy from pageable memory waits
        # for the stream's earlier work first, which under async scheduling is the step still
        # running (an eager prefill or mixed step would wait for it before it is launched, and
        # the step before would settle only after that).
        self.pinned_inputs = config.async_scheduling and device.type == "cuda"
        self.compressor = Compressor(self.caches, config, shape.head_dim, device) if config.compress else None
        self.host_kv = (HostKV(self.caches, capacity.num_host_blocks)
                        if capacity.num_host_blocks else None)
        for index, attention in enumerate(model.attention_layers()):
            attention.k_cache = self.kv_cache[0, index]
            attention.v_cache = self.kv_cache[1, index]
            attention.kv_scales = self.caches.layer_scales(index)
            if self.query_cache is not None:
                attention.query_cache = self.query_cache[index]
        # Widest block table a request can have: its whole context in blocks.
        self.max_blocks_per_seq = -(-(config.max_model_len or shape.max_position) // self.block_size)
        self.last_logits: torch.Tensor | None = None
        # The latest step's log-probabilities, for the requests that asked (`SamplingParams`
        # logprobs / prompt_logprobs): request id -> (token's, top ids, top log-probabilities),
        # and request id -> one such entry per prompt token this step computed (the first
        # prompt token has None: nothing predicts it), as (position of the first prompt token
        # covered, entries).
        self.last_logprobs: dict[str, tuple] = {}
        self.last_prompt_logprobs: dict[str, list] = {}
        self._prompt_rows: list[tuple[str, int, int]] = []
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Decode graphs of the balanced split (zipage/decode_grid.py), at the sizes where its grid
        # is wider than the batch split's: a step replays one where `takes_balanced_split` holds.
        self.balanced_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # The decode kernel's grid on this GPU: SMs (None off a GPU: the reference does not
        # split), the programs an SM holds, the KV heads of this rank's cache.
        self.streaming_multiprocessors = (torch.cuda.get_device_properties(device).multi_processor_count
                                          if device.type == "cuda" else None)
        self.decode_programs_per_sm = programs_per_sm(config.kv_cache_dtype)
        self.graph_inputs: dict[str, torch.Tensor] = {}
        # Pinned host buffers a launch stages its copies in (the decode graphs' inputs; under
        # async scheduling the row sources and the sampled ids too): two sets, one a launch in
        # turn (`_launches`), since under async scheduling a step is staged while the previous
        # one's copies may still wait behind the step before it on the device.
        self.stagings: list[dict[str, torch.Tensor]] = [{}, {}]
        self._launches = 0
        self.graph_pool = None  # one memory pool for every graph: they never run at once
        # Async scheduling: the step before the one being launched, whose sampled ids feed this
        # step's decode rows on the device (`_feed_tokens`).
        self._feeding: Launched | None = None
        # Padded prefill/mixed steps (with `prefill_graphs`): token buckets, their static
        # inputs, and two graphs per bucket (folded, and with the decode section) where graphs
        # can be captured.
        self.prefill_buckets: tuple[int, ...] = ()
        self.prefill_graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.padded_inputs: dict[str, torch.Tensor] = {}
        if cuda_graphs and device.type == "cuda":
            self.capture_decode_graphs()
        if prefill_graphs:
            self.enable_prefill_graphs(capture=cuda_graphs)

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def execute(self, plan: StepPlan, tokens: dict[str, list[int]],
                structured: StructuredOutputs | None = None) -> list[tuple[Sequence, int]]:
        """Run the forward of `plan` (prefill, decode or mixed); return (request, sampled token)
        for each request of `plan.sampled`, in that order (a partial chunk gets none). `tokens`
        holds every request's prompt + output token ids so far. `structured`: the matchers of
        the constrained requests, which mask their rows' logits before sampling (the caller
        advances them with the tokens)."""
        if self.stream is None:
            sequences, sampled = self._execute(plan, tokens, structured)
        else:
            # The step runs on the runner's high-priority stream, ordered after whatever the
            # caller queued before (and the caller's later work after it).
            caller = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(caller)
            with torch.cuda.stream(self.stream):
                sequences, sampled = self._execute(plan, tokens, structured)
            caller.wait_stream(self.stream)
        return [] if sampled is None else list(zip(sequences, sampled.tolist()))

    @torch.inference_mode()
    def launch(self, plan: StepPlan, tokens: dict[str, list[int]],
               previous: Launched | None = None) -> Launched:
        """Queue `plan`'s forward and sampling without waiting for them (async scheduling,
        zipage/engine/loop.py). `previous`: the step launched before, not waited for; each
        decode row of a request that sampled there takes that token on the device, as `tokens`
        does not hold it yet. The plan has no request that needs its tokens on the host first
        (penalties, grammars) or log-probabilities (`needs_sync`)."""
        with self._fed(previous):
            if self.stream is None:
                sequences, sampled = self._execute(plan, tokens, None, keep_logprobs=False)
                return Launched(sequences, sampled, sampled, None)
            caller = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(caller)
            with torch.cuda.stream(self.stream):
                sequences, sampled = self._execute(plan, tokens, None, keep_logprobs=False)
                host = ready = None
                if sampled is not None:
                    host = self._staging("sampled")[:len(sampled)]
                    host.copy_(sampled, non_blocking=True)
                    ready = torch.cuda.Event()
                    ready.record(self.stream)
            caller.wait_stream(self.stream)
            return Launched(sequences, sampled, host, ready)

    @contextlib.contextmanager
    def _fed(self, previous: Launched | None):
        """A launched step (rank 0's `launch`, a worker's `forward_fed`): its decode rows take
        the tokens `previous` sampled on the device (`_feed_tokens`), and it stages its copies
        in the next of the alternating staging sets."""
        self._feeding = previous if previous is not None and previous.sequences else None
        try:
            yield
        finally:
            self._feeding = None
            self._launches += 1

    @staticmethod
    def needs_sync(plan: StepPlan) -> bool:
        """Whether a request of `plan` samples from its tokens so far on the host (penalties, a
        grammar) or asks for log-probabilities: such a step runs after the previous step's
        tokens are on the host, and is waited for (`execute`), not `launch`ed."""
        sequences = plan.decode if not plan.prefill else (
            [item.seq for item in plan.prefill] + plan.decode)
        for seq in sequences:
            params = seq.sampling
            if params is not None and (params.penalized or params.structured_output is not None
                                       or params.logprobs is not None
                                       or params.prompt_logprobs is not None):
                return True
        return False

    def _staging(self, name: str) -> torch.Tensor:
        """This launch's pinned buffer `name` of async scheduling ("sources", "sampled"): one
        int64 entry a request, made at the first launch."""
        staging = self.stagings[self._launches % 2]
        if name not in staging:
            size = max(self.config.max_num_seqs, max(self.graphs, default=0))
            for each in self.stagings:
                each.update(sources=torch.empty(size, dtype=torch.int64).pin_memory(),
                            sampled=torch.empty(size, dtype=torch.int64).pin_memory())
        return staging[name]

    def _feed_tokens(self, ids: torch.Tensor, sequences: list[Sequence]) -> None:
        """Async scheduling: put into `ids` (the device's input ids of these decode rows) each
        row's token sampled by the step still running, where it sampled one there."""
        previous = self._feeding
        if previous is None or not sequences:
            return
        # By request id: a tensor-parallel worker's requests are its own copies of rank 0's.
        row_of = {seq.seq_id: row for row, seq in enumerate(previous.sequences)}
        sources = [row_of.get(seq.seq_id, -1) for seq in sequences]
        if max(sources) < 0:
            return
        if self.device.type == "cuda":
            staged = self._staging("sources")[:len(sources)]
            staged.copy_(torch.tensor(sources, dtype=torch.int64))
            sources_device = staged.to(self.device, non_blocking=True)
        else:
            sources_device = torch.tensor(sources, dtype=torch.int64)
        fed = previous.sampled.index_select(0, sources_device.clamp(min=0))
        ids.copy_(torch.where(sources_device >= 0, fed, ids))

    def _execute(self, plan: StepPlan, tokens: dict[str, list[int]],
                 structured: StructuredOutputs | None = None, keep_logprobs: bool = True
                 ) -> tuple[list[Sequence], torch.Tensor | None]:
        self._prompt_rows = []
        sequences, logits = self._forward(plan, tokens)
        self.last_logprobs, self.last_prompt_logprobs = {}, {}
        if not sequences:
            return [], None
        if self._prompt_rows:  # the rows after the sampling ones: prompt log-probabilities
            self.last_prompt_logprobs = self._prompt_logprobs(
                plan, logits[len(sequences):], tokens)
            logits = logits[:len(sequences)]
        if plan.forks:  # a fork samples from its leader's logits (docs/architecture.md)
            row_of = {seq: row for row, seq in enumerate(sequences)}
            rows = torch.tensor([row_of[fork.leader] for fork in plan.forks], device=logits.device)
            logits = torch.cat([logits, logits.index_select(0, rows)])
            sequences = sequences + [fork.seq for fork in plan.forks]
        params = [seq.sampling for seq in sequences]
        # Penalties count the request's tokens: its ids so far and where its output starts.
        history = ([(tokens[seq.seq_id], seq.prompt_len) for seq in sequences]
                   if any(p.penalized for p in params) else None)
        # Grammar masks on the logits after the forward (and after any graph replay); the
        # model's logits stay for log-probabilities. Unconstrained steps skip this entirely.
        masked = (structured.mask(logits, sequences)
                  if structured is not None and any(p.structured_output for p in params)
                  else logits)
        sampled = sample(masked, params, [seq.num_output_tokens for seq in sequences], history)
        wanted = [row for row, p in enumerate(params) if p.logprobs is not None]
        if wanted and keep_logprobs:
            rows = torch.tensor(wanted, device=logits.device)
            found = token_logprobs(logits.index_select(0, rows), sampled.index_select(0, rows),
                                   [params[row].logprobs for row in wanted])
            self.last_logprobs = {sequences[row].seq_id: entry
                                  for row, entry in zip(wanted, found)}
        return sequences, sampled

    def _prompt_logprobs(self, plan: StepPlan, logits: torch.Tensor,
                         tokens: dict[str, list[int]]) -> dict[str, list]:
        """Each prompt-logits chunk's entries: the log-probability of every prompt token given
        those before it (row t predicts token t + 1), with its top alternatives."""
        tops = {item.seq.seq_id: item.seq.sampling.prompt_logprobs for item in plan.prefill}
        found: dict[str, list] = {}
        offset = 0
        for seq_id, first, rows in self._prompt_rows:
            ids = tokens[seq_id]
            targets = torch.tensor(ids[first + 1:first + 1 + rows], device=logits.device)
            entries = token_logprobs(logits[offset:offset + rows], targets,
                                     [tops[seq_id] or 0] * rows)
            # Keyed by the position of the first prompt token covered: a chunk computed again
            # (preempted mid-prompt) replaces what it reported before.
            found[seq_id] = (0, [None] + entries) if first == 0 else (first + 1, entries)
            offset += rows
        return found

    @torch.inference_mode()
    def forward(self, plan: StepPlan, tokens: dict[str, list[int]]) -> None:
        """The step's compressions and forward pass without sampling: what a tensor-parallel
        worker rank runs (rank 0 samples from the gathered logits, `zipage/engine/parallel.py`)."""
        if self.stream is None:
            self._forward(plan, tokens)
            return
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            self._forward(plan, tokens)
        caller.wait_stream(self.stream)

    def forward_fed(self, plan: StepPlan, tokens: dict[str, list[int]],
                    previous: Launched | None) -> None:
        """`forward` of a step launched under async scheduling on a tensor-parallel worker: each
        decode row of a request that sampled in `previous` (the step before, its `sampled` the
        ids rank 0 broadcast) takes that token on the device, as `launch` feeds rank 0's."""
        with self._fed(previous):
            self.forward(plan, tokens)

    def _forward(self, plan: StepPlan, tokens: dict[str, list[int]]
                 ) -> tuple[list[Sequence], torch.Tensor | None]:
        if plan.kv_saves or plan.kv_loads:  # the host tier's, before anything of the step
            self.host_kv.copy(plan.kv_saves, plan.kv_loads)
        compressor = self.compressor
        launch = compressor is not None and plan.compress_launch is not None
        if compressor is not None and plan.compress_sync:
            compressor.run(plan.compress_sync)  # its requests decode in this very forward
        sequences, logits = [], None
        if plan.prefill:  # a prefill or mixed step: one forward over chunks and decode rows
            sequences = [item.seq for item in plan.prefill if item.samples] + plan.decode
            logits = self._prefill(plan, tokens)
            if plan.forks:
                self.caches.copy_blocks(plan.block_copies)  # after the forward wrote them
        elif plan.decode:
            sequences = plan.decode
            logits = self._decode(sequences, tokens)
        # An async batch goes in behind the forward: the host queues its ~20 launches per layer
        # group while the GPU runs the forward, instead of before it, where they delayed the
        # forward's start by their whole host time (3-7 ms a launching step on the H200;
        # docs/cost_model.md, 'Async compression on the GPU'). Its requests are not in this
        # forward, and its stream waits for it, so it starts on the GPU when the forward ends.
        if launch:
            compressor.launch(plan.compress_launch)
        self.last_logits = logits  # for analysis (teacher-forced fidelity); never copied
        return sequences, logits

    def step_inputs(self, plan: StepPlan, tokens: dict[str, list[int]]) -> StepInputs:
        """Host tensors of a prefill or mixed step: the rows of every prompt chunk, in plan order,
        then one row per decode request (docs/architecture.md, 'The engine'). Built a column at a
        time with array arithmetic: a few small torch ops per chunk cost 2-3.5 ms of host time for
        a 2,048-token step of 39 chunks, which an async engine's first step cannot hide."""
        b, items = self.block_size, plan.prefill
        starts = np.fromiter((item.num_cached_tokens for item in items), np.int64, len(items))
        ends = np.fromiter((item.num_tokens for item in items), np.int64, len(items))
        cu_seqlens = np.zeros(len(items) + 1, dtype=np.int64)
        np.cumsum(ends - starts, out=cu_seqlens[1:])
        chunk_rows = int(cu_seqlens[-1])
        # Each row's chunk, and its KV entry (chunks come before a request's first compression:
        # KV index == position).
        chunk = np.repeat(np.arange(len(items)), ends - starts)
        entries = np.arange(chunk_rows, dtype=np.int64) + (starts - cu_seqlens[:-1])[chunk]
        input_ids = np.fromiter(itertools.chain.from_iterable(
            tokens[item.seq.seq_id][item.num_cached_tokens:item.num_tokens] for item in items),
            np.int64, chunk_rows)
        tables = _padded_tables([item.seq.block_table for item in items])
        table_blocks = entries // b
        widths = np.fromiter((len(item.seq.block_table) for item in items), np.int64, len(items))
        if (table_blocks >= widths[chunk]).any():  # else the padding's block 0 would take its KV
            raise RuntimeError("a prefill chunk reaches past its request's block table")
        slots = tables[chunk, table_blocks].astype(np.int64) * b + entries % b
        # A chunk stores the queries of the entries `WindowLayout.query_range` names: from its
        # first such entry to the chunk's end (none without a query slot).
        query_slot = np.fromiter((-1 if item.seq.query_slot is None else item.seq.query_slot
                                  for item in items), np.int64, len(items))
        first = np.fromiter((self.windows.query_range(item.seq.query_slot, item.num_cached_tokens,
                                                      item.num_tokens)[0] for item in items),
                            np.int64, len(items))
        query_slots = np.where((query_slot[chunk] >= 0) & (entries >= first[chunk]),
                               self.windows.row(query_slot[chunk], entries), -1)
        logits_rows = [int(cu_seqlens[index + 1]) - 1 for index, item in enumerate(items) if item.samples]
        columns = [input_ids, entries, slots, query_slots]
        decode = None
        if plan.decode:
            width = max(len(seq.block_table) for seq in plan.decode)
            decode_columns, decode_tables = self._decode_inputs(plan.decode, tokens,
                                                                len(plan.decode), width)
            decode_columns = decode_columns.numpy()
            columns = [np.concatenate([column, decode_columns[row]])
                       for column, row in zip(columns, (0, 1, 2, 4))]
            logits_rows.extend(range(chunk_rows, chunk_rows + len(plan.decode)))
            decode = (torch.from_numpy(decode_columns[3].astype(np.int32)), decode_tables)
        prompt_rows = []
        for index, item in enumerate(items):
            if item.prompt_logits:  # every row but the sampling one predicts a prompt token
                rows = item.num_new_tokens - (1 if item.samples else 0)
                if rows > 0:
                    first_row = int(cu_seqlens[index])
                    logits_rows.extend(range(first_row, first_row + rows))
                    prompt_rows.append((item.seq.seq_id, item.num_cached_tokens, rows))
        self._prompt_rows = prompt_rows
        input_ids, positions, slot_mapping, query_slot_mapping = map(torch.from_numpy, columns)
        return StepInputs(
            input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
            query_slot_mapping=query_slot_mapping,
            cu_seqlens_q=torch.from_numpy(cu_seqlens.astype(np.int32)),
            context_lens=torch.from_numpy(ends.astype(np.int32)),
            block_tables=torch.from_numpy(tables),
            decode_context_lens=None if decode is None else decode[0],
            decode_block_tables=None if decode is None else decode[1],
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64),
            max_q_len=max(item.num_new_tokens for item in items),
            prompt_rows=prompt_rows)

    def _prefill(self, plan: StepPlan, tokens: dict[str, list[int]]) -> torch.Tensor | None:
        """A prefill or mixed step, eagerly: the chunk rows attend through the varlen prefill
        kernel, the decode rows through the split-K decode kernel, in each layer. Returns the
        logits of the rows that sample (None when every chunk is partial)."""
        inputs = self.step_inputs(plan, tokens)
        bucket = bucket_of(len(inputs.input_ids), self.prefill_buckets)
        if bucket is not None:
            return self._prefill_padded(inputs, bucket, plan.decode)
        device = self._to_device
        decoding = inputs.decode_context_lens is not None
        context = ForwardContext(
            is_prefill=True, slot_mapping=device(inputs.slot_mapping),
            cu_seqlens_q=device(inputs.cu_seqlens_q), context_lens=device(inputs.context_lens),
            block_tables=device(inputs.block_tables), max_q_len=inputs.max_q_len,
            num_prefill_tokens=int(inputs.cu_seqlens_q[-1]),
            decode_context_lens=device(inputs.decode_context_lens) if decoding else None,
            decode_block_tables=device(inputs.decode_block_tables) if decoding else None,
            logits_indices=device(inputs.logits_indices),
            query_slot_mapping=self._query_mapping(inputs.query_slot_mapping))
        input_ids = device(inputs.input_ids)
        if plan.decode:
            self._feed_tokens(input_ids[len(input_ids) - len(plan.decode):], plan.decode)
        with forward_context(context):
            hidden = self.model(input_ids, device(inputs.positions))
            if inputs.logits_indices.numel() == 0:
                return None
            return self.model.compute_logits(hidden)

    def _decode_inputs(self, sequences: list[Sequence], tokens: dict[str, list[int]],
                       rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host tensors for a decode step, padded to `rows` requests and `width` table columns.

        Returns an int64 [5, rows] tensor (token, position, KV slot, context length, query-cache
        index) and an int32 [rows, width] block table. Padded rows attend to one entry of block 0
        and store nothing, so they cannot disturb real requests.
        """
        b, count = self.block_size, len(sequences)
        tables = np.empty((rows, width), dtype=np.int32)
        self.host_tables.fill(sequences, tables)
        # Each column whole from one list of the requests' values, the rest by array arithmetic:
        # per-request Python was most of a decode step's host time at batch 256.
        columns = np.empty((5, rows), dtype=np.int64)
        columns[:, count:] = np.array([[0], [0], [-1], [1], [-1]])
        columns[0, :count] = [tokens[seq.seq_id][-1] for seq in sequences]
        columns[1, :count] = [seq.position for seq in sequences]
        kv_len = np.array([seq.kv_len for seq in sequences], dtype=np.int64)
        columns[2, :count] = tables[np.arange(count), kv_len // b].astype(np.int64) * b + kv_len % b
        columns[3, :count] = kv_len + 1
        slots = np.array([-1 if seq.query_slot is None else seq.query_slot for seq in sequences],
                         dtype=np.int64)
        columns[4, :count] = self.windows.decode_rows(slots, kv_len)
        return torch.from_numpy(columns), torch.from_numpy(tables)

    def decode_split(self, context_lens: np.ndarray, grid_rows: int) -> str | None:
        """"balanced" where a decode step's longest row gets more partitions that way
        (zipage/decode_grid.py `takes_balanced_split`; `grid_rows`: the rows the kernel's grid is
        sized for), else None: the kernel's batch split."""
        if self.streaming_multiprocessors is None or not len(context_lens):
            return None
        balanced = takes_balanced_split(grid_rows, int(context_lens.sum()), int(context_lens.max()),
                                        self.kv_cache.shape[4], self.streaming_multiprocessors,
                                        programs_per_sm=self.decode_programs_per_sm)
        return "balanced" if balanced else None

    def _decode(self, sequences: list[Sequence], tokens: dict[str, list[int]]) -> torch.Tensor:
        batch = len(sequences)
        bucket = next((size for size in self.graphs if size >= batch), None)
        width = max(len(seq.block_table) for seq in sequences)
        if bucket is None:
            columns, tables = self._decode_inputs(sequences, tokens, batch, width)
            split = self.decode_split(columns[3].numpy(), batch)
            columns, tables = self._to_device(columns), self._to_device(tables)
            context = ForwardContext(
                is_prefill=False, slot_mapping=columns[2], context_lens=columns[3].int(),
                block_tables=tables, query_slot_mapping=columns[4]
                if self.query_cache is not None else None, decode_split=split)
            self._feed_tokens(columns[0], sequences)
            with forward_context(context):
                hidden = self.model(columns[0], columns[1])
                return self.model.compute_logits(hidden)
        # Graph replay: stage the padded inputs in pinned memory, copy them into the graph's
        # static tensors without blocking the host, replay. Only the table columns this batch
        # uses are built and copied: the graph's table is max_model_len / b wide (640 columns
        # for Qwen3 at b = 64), and building it whole in Python cost ~5 ms a step. Stale columns
        # beyond are never read (the kernel stops at each row's context length).
        static = self.graph_inputs
        columns, tables = self._decode_inputs(sequences, tokens, bucket, width)
        staging = self.stagings[self._launches % 2]
        staged_columns = staging["columns"][:, :bucket]
        staged_tables = staging["tables"].view(-1)[:bucket * width].view(bucket, width)
        staged_columns.copy_(columns)
        staged_tables.copy_(tables)
        static["columns"][:, :bucket].copy_(staged_columns, non_blocking=True)
        static["block_tables"][:bucket, :width].copy_(
            staged_tables.to(self.device, non_blocking=True))
        static["context_lens"][:bucket].copy_(static["columns"][3, :bucket])
        self._feed_tokens(static["columns"][0, :batch], sequences)
        balanced = self.decode_split(columns[3, :batch].numpy(), bucket) is not None
        (self.balanced_graphs if balanced else self.graphs)[bucket].replay()
        return static["logits"][:batch]

    # ------------------------------------------------------------------ CUDA graphs

    def capture_decode_graphs(self) -> None:
        """Capture one decode graph per batch size of the ladder, largest first (shared pool),
        and one of the balanced split where its grid is wider."""
        largest = min(self.config.max_num_seqs, GRAPH_BATCH_SIZES[-1])
        sizes = [size for size in GRAPH_BATCH_SIZES if size <= largest]
        self.allocate_graph_inputs(largest)
        static = self.graph_inputs
        pool = None
        grid = dict(num_kv_heads=self.kv_cache.shape[4],
                    streaming_multiprocessors=self.streaming_multiprocessors,
                    programs_per_sm=self.decode_programs_per_sm)
        for size in reversed(sizes):
            splits = [None]
            if decode_grid_partitions(size, **grid, split="balanced") > decode_grid_partitions(size, **grid):
                splits.append("balanced")
            for split in splits:
                graph = torch.cuda.CUDAGraph()
                inputs = static["columns"][0, :size], static["columns"][1, :size]
                with forward_context(self.graph_context(size, split)), torch.inference_mode():
                    # Warm up outside the graph (Triton compiles and autotunes on first call).
                    self.model.compute_logits(self.model(*inputs))
                    torch.cuda.synchronize()
                    with torch.cuda.graph(graph, pool=pool):
                        hidden = self.model(*inputs)
                        static["logits"][:size] = self.model.compute_logits(hidden)
                pool = graph.pool()
                (self.balanced_graphs if split else self.graphs)[size] = graph
        self.graphs = dict(sorted(self.graphs.items()))
        self.graph_pool = pool
        torch.cuda.synchronize()

    def allocate_graph_inputs(self, largest: int) -> None:
        """The decode graphs' static inputs and logits for up to `largest` requests, and the host
        staging buffers they are filled from (pinned on a GPU, so copies do not block the host)."""
        device = self.device
        columns = torch.zeros(5, largest, dtype=torch.int64, device=device)
        columns[2:5:2] = -1  # store nothing anywhere until real requests fill the rows
        self.graph_inputs = {
            "columns": columns,  # token, position, KV slot, context length, query index
            "context_lens": torch.ones(largest, dtype=torch.int32, device=device),
            "block_tables": torch.zeros(largest, self.max_blocks_per_seq, dtype=torch.int32,
                                        device=device),
            "logits": torch.empty(largest, self.shape.vocab_size, dtype=self.dtype,
                                  device=device),
        }
        for staging in self.stagings:
            buffers = {
                "columns": torch.zeros(5, largest, dtype=torch.int64),
                "tables": torch.zeros(largest, self.max_blocks_per_seq, dtype=torch.int32),
            }
            if device.type == "cuda":
                buffers = {name: tensor.pin_memory() for name, tensor in buffers.items()}
            staging.update(buffers)

    def graph_context(self, size: int, split: str | None = None) -> ForwardContext:
        """The forward context a decode graph of `size` rows is captured (and replayed) with."""
        static = self.graph_inputs
        return ForwardContext(
            is_prefill=False, slot_mapping=static["columns"][2, :size],
            context_lens=static["context_lens"][:size],
            block_tables=static["block_tables"][:size],
            query_slot_mapping=static["columns"][4, :size] if self.query_cache is not None
            else None, decode_split=split)

    # ------------------------------------------------------------------ padded prefill / mixed steps

    @property
    def graphed_steps(self) -> dict[str, bool]:
        """Which steps replay CUDA graphs: decode steps, prefill and mixed steps (what a run
        summary and a calibrated profile record as `graphs`: the two paths cost differently)."""
        return {"decode": bool(self.graphs), "prefill": bool(self.prefill_graphs)}

    @property
    def decode_graph_sizes(self) -> list[int]:
        """The batch sizes decode graphs were captured at (none: decode runs eagerly): a decode
        step computes the smallest that holds its batch (what a profile records)."""
        return sorted(self.graphs)

    def warm_logits(self) -> None:
        """Run the LM head outside a graph once for every count of rows it can see there (the
        sampling rows of a prefill or mixed step, a decode batch above the graphs: 1 ..
        max_num_seqs). On a GPU, cuBLAS's first matmul of a shape makes the host wait until the
        device is idle: under async scheduling the 8B headline's first two steps each lost their
        overlap with the step before to it (docs/BENCHMARKS.md, 'Async scheduling'). `warm_up`
        calls it on a GPU only (~0.25 s for an 8B model at 512 counts); under tensor parallelism
        every rank runs it, as the logits gather is a collective."""
        hidden = torch.zeros(self.config.max_num_seqs, self.shape.hidden_size, dtype=self.dtype,
                             device=self.device)
        stream = contextlib.nullcontext() if self.stream is None else torch.cuda.stream(self.stream)
        with torch.inference_mode(), forward_context(ForwardContext()), stream:
            for rows in range(1, len(hidden) + 1):
                self.model.compute_logits(hidden[:rows])
        if self.stream is not None:
            torch.cuda.synchronize(self.device)

    def enable_prefill_graphs(self, capture: bool = True) -> None:
        """Run prefill and mixed steps of up to the largest bucket through the padded layout, and
        on a GPU (with `capture`) replay a CUDA graph per bucket. Elsewhere (the CPU, tests) the
        padded layout runs eagerly: exactly the captured forward, so what a graph computes is
        what the CPU tests check."""
        self.prefill_buckets = buckets_up_to(self.config.step_tokens)
        if not self.prefill_buckets:
            return
        self.allocate_padded_inputs(self.prefill_buckets[-1])
        if capture and self.device.type == "cuda":
            self.capture_prefill_graphs()

    def bucket_sequences(self, bucket: int) -> int:
        """Most sequences a step of `bucket` rows can hold: each has at least one row."""
        return min(bucket, self.config.max_num_seqs)

    def bucket_work_items(self, bucket: int) -> int:
        return prefill_work_capacity(bucket, self.bucket_sequences(bucket), self.tile_tokens)

    @property
    def tile_tokens(self) -> int:
        return prefill_tile_tokens(self.shape.num_heads, self.shape.num_kv_heads)

    def allocate_padded_inputs(self, largest: int) -> None:
        """Static tensors of the padded layout for up to `largest` rows; bucket b uses their
        first rows / sequences / work items (`padded_context`), so one set serves every bucket."""
        device, seqs = self.device, self.bucket_sequences(largest)
        slots = decode_section_rows(largest)
        rows = torch.zeros(4, largest, dtype=torch.int64, device=device)
        rows[2:] = -1  # store no KV and no query until a step fills them
        self.padded_inputs = {
            "rows": rows,  # token, position, KV slot, query-cache index
            "cu_seqlens_q": torch.zeros(seqs + 1, dtype=torch.int32, device=device),
            "context_lens": torch.zeros(seqs, dtype=torch.int32, device=device),
            "block_tables": torch.zeros(seqs, self.max_blocks_per_seq, dtype=torch.int32,
                                        device=device),
            "work_items": torch.full((self.bucket_work_items(largest), 2), -1, dtype=torch.int32,
                                     device=device),
            # The decode section (`DecodeSection`): rows, filled, context lens, block tables.
            "section_rows": torch.zeros(slots, dtype=torch.int64, device=device),
            "section_filled": torch.zeros(slots, 1, 1, dtype=torch.bool, device=device),
            "section_context_lens": torch.zeros(slots, dtype=torch.int32, device=device),
            "section_block_tables": torch.zeros(slots, self.max_blocks_per_seq,
                                                dtype=torch.int32, device=device),
            "hidden": torch.empty(largest, self.shape.hidden_size, dtype=self.dtype, device=device),
        }

    def padded_context(self, bucket: int, sectioned: bool) -> ForwardContext:
        """The forward context of a padded step of `bucket` rows (captured and replayed with);
        `sectioned`: with the decode section."""
        static, seqs = self.padded_inputs, self.bucket_sequences(bucket)
        slots = decode_section_rows(bucket)
        return ForwardContext(
            is_prefill=True, slot_mapping=static["rows"][2, :bucket],
            cu_seqlens_q=static["cu_seqlens_q"][:seqs + 1],
            context_lens=static["context_lens"][:seqs],
            block_tables=static["block_tables"][:seqs],
            prefill_work=PrefillWork(static["work_items"][:self.bucket_work_items(bucket)],
                                     self.tile_tokens),
            decode_section=DecodeSection(
                static["section_rows"][:slots], static["section_filled"][:slots],
                static["section_context_lens"][:slots], static["section_block_tables"][:slots],
                DECODE_SECTION_GRID_BATCH) if sectioned else None,
            query_slot_mapping=static["rows"][3, :bucket] if self.query_cache is not None
            else None)

    def padded_forward(self, bucket: int, sectioned: bool) -> torch.Tensor:
        """The forward of a padded step on the static inputs, to the last hidden states of its
        `bucket` rows: what a prefill graph captures (two per bucket: with the decode section and
        without). The logits are left out: a graph would compute them for every sequence the
        bucket can hold (up to 512 rows of the LM head, ~1 ms of the Qwen3-8B's 512-token step on
        an H200), where a step samples a few."""
        static = self.padded_inputs
        with forward_context(self.padded_context(bucket, sectioned)):
            return self.model(static["rows"][0, :bucket], static["rows"][1, :bucket])

    def padded_layout(self, inputs: StepInputs, bucket: int) -> tuple[dict[str, torch.Tensor], bool]:
        """Host tensors of `inputs` in the padded layout of `bucket` rows, and whether the step
        takes the decode section (`takes_decode_section`).

        The decode rows become sequences of one new token, so the step's size depends on the
        bucket only. Without the section they are `PrefillWork` items like any tile; with it they
        fill its first slots and have no work item. Padding: rows store nothing (slot -1, query
        -1), padding sequences are empty (context 0, no work item), padding work items are
        (-1, -1), empty slots name row 0 with no entries.
        """
        num_rows, seqs = len(inputs.input_ids), self.bucket_sequences(bucket)
        cu, lens, tables = inputs.cu_seqlens_q, inputs.context_lens, [inputs.block_tables]
        query_lens = (cu[1:] - cu[:-1]).long()
        layout, sectioned = {}, False
        if inputs.decode_context_lens is not None:
            decodes = len(inputs.decode_context_lens)
            sectioned = takes_decode_section(bucket, decodes, int(inputs.decode_context_lens.max()))
            first_row = int(cu[-1])
            cu = torch.cat((cu, cu[-1] + torch.arange(1, decodes + 1, dtype=torch.int32)))
            lens = torch.cat((lens, inputs.decode_context_lens))
            tables.append(inputs.decode_block_tables)
            query_lens = torch.cat((query_lens, torch.full((decodes,), 0 if sectioned else 1)))
            if sectioned:
                slots = decode_section_rows(bucket)
                layout["section_rows"] = torch.zeros(slots, dtype=torch.int64)
                layout["section_rows"][:decodes] = torch.arange(first_row, first_row + decodes)
                layout["section_filled"] = torch.zeros(slots, 1, 1, dtype=torch.bool)
                layout["section_filled"][:decodes] = True
                layout["section_context_lens"] = torch.zeros(slots, dtype=torch.int32)
                layout["section_context_lens"][:decodes] = inputs.decode_context_lens
                layout["section_block_tables"] = inputs.decode_block_tables
        padding = seqs - len(lens)
        cu = torch.cat((cu, cu[-1:].expand(padding)))
        lens = torch.cat((lens, torch.zeros(padding, dtype=torch.int32)))
        query_lens = torch.cat((query_lens, torch.zeros(padding, dtype=torch.int64)))
        rows = torch.tensor([0, 0, -1, -1], dtype=torch.int64)[:, None].repeat(1, bucket)
        rows[:, :num_rows] = torch.stack((inputs.input_ids, inputs.positions,
                                          inputs.slot_mapping, inputs.query_slot_mapping))
        work = prefill_work(query_lens, self.tile_tokens, self.bucket_work_items(bucket))
        width = max(table.shape[1] for table in tables)
        layout.update(rows=rows, cu_seqlens_q=cu, context_lens=lens,
                      block_tables=torch.cat([_widen(table, width) for table in tables]),
                      work_items=work.items)
        return layout, sectioned

    def _prefill_padded(self, inputs: StepInputs, bucket: int,
                        decode: list[Sequence] = ()) -> torch.Tensor | None:
        """Stage a step into the static inputs of its bucket, then replay the bucket's graph (or,
        without one, run the same padded forward eagerly). `decode`: the step's decode requests,
        whose rows end the step's rows."""
        layout, sectioned = self.padded_layout(inputs, bucket)
        static = self.padded_inputs
        # Each into the leading part of its static tensor. Of the block tables only the rows and
        # columns this step uses are written: stale entries beyond are never read.
        for name, tensor in layout.items():
            static[name][tuple(slice(0, size) for size in tensor.shape)].copy_(
                self._to_device(tensor))
        if decode:
            rows = len(inputs.input_ids)
            self._feed_tokens(static["rows"][0, rows - len(decode):rows], decode)
        # Before the replay: a copy from pageable memory waits for the stream, so after it the
        # host would queue the logits only once the whole graph had run.
        indices = self._to_device(inputs.logits_indices) if inputs.logits_indices.numel() else None
        graph = self.prefill_graphs.get((bucket, sectioned))
        if graph is None:
            hidden = self.padded_forward(bucket, sectioned)
        else:
            graph.replay()
            hidden = static["hidden"][:bucket]
        if indices is None:
            return None
        with forward_context(ForwardContext(logits_indices=indices)):
            return self.model.compute_logits(hidden)

    def capture_prefill_graphs(self) -> None:
        """Two graphs per token bucket (with the decode section and without), largest first, in
        the decode graphs' memory pool."""
        static = self.padded_inputs
        for bucket, sectioned in itertools.product(reversed(self.prefill_buckets), (False, True)):
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode():
                self.padded_forward(bucket, sectioned)  # warm-up outside the graph (Triton compiles)
                torch.cuda.synchronize()
                with torch.cuda.graph(graph, pool=self.graph_pool):
                    static["hidden"][:bucket] = self.padded_forward(bucket, sectioned)
            self.graph_pool = graph.pool()
            self.prefill_graphs[bucket, sectioned] = graph
        torch.cuda.synchronize()

    # ------------------------------------------------------------------ helpers

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.pinned_inputs:
            tensor = tensor.pin_memory()  # (the host allocator reuses it once the copy is done)
        return tensor.to(self.device, non_blocking=True)

    def _query_mapping(self, mapping: torch.Tensor) -> torch.Tensor | None:
        if self.query_cache is None:
            return None
        return self._to_device(mapping)


def _widen(table: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(table, (0, width - table.shape[1]))


def _padded_tables(tables: list[list[int]]) -> np.ndarray:
    """int32 [len(tables), longest]: each block table, zero-padded on the right."""
    padded = np.zeros((len(tables), max(len(table) for table in tables)), dtype=np.int32)
    for row, table in enumerate(tables):
        padded[row, :len(table)] = table
    return padded
