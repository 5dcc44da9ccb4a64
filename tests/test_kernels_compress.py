"""The compression pipeline (docs/architecture.md, 'Compression pipeline'): the torch reference's
pieces against tiny hand-computed cases,
and the Triton kernels against the reference through the Triton interpreter (CPU, float32 and float16; the
interpreter mis-computes bfloat16 dots, which bench/compress_gpu.py checks on a GPU).

Triton decides whether it interprets when it is first imported, so the Triton tests run in a child pytest process
started with ``TRITON_INTERPRET=1`` (``test_triton_kernels_under_the_interpreter``); in the parent they are skipped
and the parent never imports Triton. Run them directly with ``TRITON_INTERPRET=1 pytest
tests/test_kernels_compress.py``. A second child, started alongside, compiles every kernel for Hopper without a
GPU.

How Triton is compared with the reference, per random batch: final scores and global scores must agree to float32
rounding; the kept sets (top-k) must agree except where the reference scores tie with the k-th largest within
that rounding (max-pooling copies a score onto its neighbours, so without redundancy exact ties at the cut are
common and either choice is right); the K, V and score caches written by Triton must equal, bit for bit, what the
reference compaction writes given Triton's kept sets, and equal the reference pipeline's caches outright when
every kept set agrees.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from triton_interpreter import (  # noqa: E402
    HOPPER_COMMAND,
    TRITON_INSTALLED,
    UNDER_INTERPRETER,
    check_hopper_compilation,
    compile_for_hopper,
    compiler_environment,
    under_interpreter,
)

from zipage.config import ZipageConfig  # noqa: E402
from zipage.errors import ConfigError  # noqa: E402
from zipage.kernels import compress as compress_module  # noqa: E402
from zipage.kernels.compress import CompressionInputs  # noqa: E402
from zipage.kernels.compress_ref import (  # noqa: E402
    CompressionParams,
    attention_scores,
    compress_ref,
    final_scores,
    kept_entries,
    pool_scores,
    redundancy_scores,
    update_global_scores,
    write_kept_entries,
)
from zipage.kernels.kv_quant_ref import dequantize_kv, quantize_kv  # noqa: E402

E = math.e


# ---------------------------------------------------------------- the reference against hand-computed cases


def test_attention_score_of_one_block_by_hand():
    """b = 4, w = 2, one KV head serving two query heads, scale 1. Window query u sits at offset 2 + u."""
    queries = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[0.0, 0.0], [1.0, 1.0]]])  # [w, Hq, d]
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 0.0]])[:, None, :]  # [4, Hkv, d]
    scores = attention_scores(queries, keys, length=4, block_size=4, scale=1.0)
    # u = 0 sees offsets 0..2: head 0 logits (1, 0, 1), head 1 logits (0, 1, 1); max over heads per entry.
    first_row = [E / (2 * E + 1), E / (2 * E + 1), E / (2 * E + 1), 0.0]
    # u = 1 sees all four: head 0 is uniform, head 1 logits (1, 1, 2, 2).
    second_row = [max(0.25, 1 / (2 + 2 * E)), max(0.25, 1 / (2 + 2 * E)), max(0.25, E / (2 + 2 * E)),
                  max(0.25, E / (2 + 2 * E))]
    expected = torch.tensor([[(a + b) / 2 for a, b in zip(first_row, second_row)]])
    torch.testing.assert_close(scores, expected)


def test_global_score_decays_all_but_the_last_block():
    scores = torch.tensor([[0.1, 0.5, 0.2, 0.3]])
    previous = torch.tensor([[1.0, 0.1, 9.0, 9.0]])
    merged = update_global_scores(scores, previous, compressed=True, block_size=2, alpha=0.5)
    # Block 0 merges max(0.5 * F, S); block 1 holds tokens decoded since the last compression: raw S.
    torch.testing.assert_close(merged, torch.tensor([[0.5, 0.5, 0.2, 0.3]]))
    assert update_global_scores(scores, previous, compressed=False, block_size=2, alpha=0.5) is scores


def test_pooling_spreads_a_peak_over_its_neighbours():
    pooled = pool_scores(torch.tensor([[0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 1.0]]), kernel=5)
    torch.testing.assert_close(pooled, torch.tensor([[5.0, 5.0, 5.0, 5.0, 5.0, 1.0, 1.0, 1.0]]))


def test_redundancy_zeroes_the_newest_similar_row_of_each_column():
    """Keys k0 = k1 = (1, 0), k2 = (0, 1), k3 = (1, 1): similarities 1 (k0, k1), 1/sqrt(2) (k3 with the rest).
    Threshold 0.5: columns 0, 1 and 2 lose their entry in row 3 (the newest above it), column 3 its entry in
    row 2. Row sums: 1 + 1/sqrt(2) for k0 and k1, 0 for k2 and k3."""
    keys = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])[:, None, :]
    row_sum = 1 + 1 / math.sqrt(2)
    tau = 0.4
    expected = torch.softmax(torch.tensor([[row_sum, row_sum, 0.0, 0.0]]) / (tau * 4), dim=-1)
    # All pairs over two blocks of 2, and within one block of 4: the same comparison set, the same answer.
    flash = redundancy_scores(keys, "flash", block_size=2, threshold=0.5, tau=tau)
    lightning = redundancy_scores(keys, "lightning", block_size=4, threshold=0.5, tau=tau)
    torch.testing.assert_close(flash, expected)
    torch.testing.assert_close(lightning, expected)
    # Within blocks of 2 each pair is the other's newest similar row: everything is zeroed, R is uniform.
    split = redundancy_scores(keys, "lightning", block_size=2, threshold=0.5, tau=tau)
    torch.testing.assert_close(split, torch.full((1, 4), 0.25))


def test_final_score_weights_and_the_window():
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn((8, 1, 4), generator=generator)
    queries = torch.randn((2, 1, 4), generator=generator)
    params = CompressionParams(block_size=4, window=2, global_score=False, pooling="first", redundancy="flash")
    scores, stored = final_scores(keys, queries, None, compressed=True, params=params, scale=0.5)
    attention = attention_scores(queries, keys, 8, 4, 0.5)  # compressed: "first" does not pool
    redundancy = redundancy_scores(keys, "flash", 4, params.similarity_threshold, params.tau)
    expected = params.lambda_weight * attention - (1 - params.lambda_weight) * redundancy
    torch.testing.assert_close(scores[:, :-2], expected[:, :-2])
    assert stored is None and torch.all(scores[:, -2:] == float("inf"))


def test_compaction_keeps_order_and_may_overwrite_its_sources():
    """Two heads keep different entries of source blocks (3, 1, 2) into targets (3, 0): block 3 is both read and
    written. Entry values encode (block, offset, head) so the written order is visible."""
    num_blocks, block_size, heads = 4, 2, 2
    ids = torch.arange(num_blocks * block_size * heads, dtype=torch.float32).view(num_blocks, block_size, heads, 1)
    k_cache, v_cache = ids.clone(), -ids.clone()
    score_cache = torch.zeros((num_blocks, block_size, heads))
    source, target = torch.tensor([3, 1, 2]), torch.tensor([3, 0])
    kept = torch.tensor([[1, 2, 4, 5], [0, 3, 4, 5]])  # sequence entries kept by head 0 and by head 1
    stored = torch.arange(12, dtype=torch.float32).view(heads, 6) / 10
    write_kept_entries(k_cache, v_cache, score_cache, source, target, kept, stored)
    sequence = ids[source].flatten(0, 1)[:, :, 0]  # [6 entries, heads]
    for head in range(heads):
        written = torch.cat([k_cache[3, :, head, 0], k_cache[0, :, head, 0]])
        assert torch.equal(written, sequence[kept[head], head])
        assert torch.equal(torch.cat([v_cache[3, :, head, 0], v_cache[0, :, head, 0]]), -written)
        torch.testing.assert_close(torch.cat([score_cache[3, :, head], score_cache[0, :, head]]),
                                   stored[head, kept[head]])
    assert torch.equal(k_cache[1], ids[1]) and torch.equal(k_cache[2], ids[2])  # released blocks untouched


def test_kept_entries_are_the_top_k_in_sequence_order():
    scores = torch.tensor([[0.3, 0.9, 0.1, 0.8, float("inf"), float("inf")]])
    assert kept_entries(scores, 4).tolist() == [[1, 3, 4, 5]]


def test_kept_entries_break_ties_to_the_lowest_position():
    scores = torch.tensor([[1.0, 2.0, 2.0, 2.0, 2.0, 1.0, float("inf")],
                           [5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0]])
    assert kept_entries(scores, 3).tolist() == [[1, 2, 6], [0, 1, 2]]
    # Rows full of ties (four distinct values) against a stable sort, batched as the Triton path
    # calls it ([L, R, Hkv, length]).
    generator = torch.Generator().manual_seed(0)
    for keep in (1, 7, 32, 63):
        scores = torch.randint(0, 4, (2, 3, 2, 64), generator=generator).float()
        expected = scores.sort(dim=-1, descending=True, stable=True).indices[..., :keep]
        assert torch.equal(kept_entries(scores, keep), expected.sort(dim=-1).values)


def test_kept_entries_with_a_count_per_row():
    """Requests with budgets of their own: each row keeps its own count (the rest of the row holds the row's
    last position), exactly the row's `kept_entries` with that count, ties included."""
    scores = torch.tensor([[1.0, 2.0, 2.0, 2.0, 2.0, 1.0, float("inf")],
                           [5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0],
                           [0.3, 0.9, 0.1, 0.8, 0.2, 0.0, float("inf")]])
    counts = torch.tensor([[3], [1], [5]])
    assert kept_entries(scores, counts, 5).tolist() == [[1, 2, 6, 6, 6], [0, 6, 6, 6, 6],
                                                        [0, 1, 3, 4, 6]]
    generator = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 4, (2, 3, 2, 64), generator=generator).float()
    counts = torch.tensor([16, 48, 32]).view(1, 3, 1, 1).expand(2, 3, 2, 1)
    kept = kept_entries(scores, counts, 48)
    for request, count in enumerate((16, 48, 32)):
        assert torch.equal(kept[:, request, :, :count], kept_entries(scores[:, request], count))


def ragged(batch: "Batch") -> "Batch":
    """`make_batch`'s three requests with their own numbers of target blocks (3, 1, 2), as requests with
    budgets of their own (or elastic caps) in one batch: request 0 keeps a third block (its own block 2, in
    place), request 1 only its block 0; the table is padded with -1."""
    sources, targets = batch.source_tables.tolist(), batch.target_tables.tolist()
    rows = [targets[0] + [sources[0][2]], targets[1][:1] + [-1, -1], targets[2] + [-1]]
    return replace(batch, target_tables=torch.tensor(rows, dtype=torch.int32),
                   num_target_blocks=torch.tensor([3, 1, 2], dtype=torch.int32))


def test_reference_keeps_each_requests_own_count():
    """One ragged batch gives what each request gives compressed alone into its own target blocks."""
    params = CompressionParams(block_size=16, window=4)
    batch = ragged(make_batch(torch.float32, group=2, block_size=16, window=4, seed=3))
    together = batch.clone()
    compress_ref(*together.arguments(params, SCALE), num_target_blocks=together.num_target_blocks)
    alone = batch.clone()
    for request, count in enumerate(batch.num_target_blocks.tolist()):
        rows = slice(request, request + 1)
        compress_ref(alone.k_cache, alone.v_cache, alone.score_cache, alone.query_cache,
                     batch.source_tables[rows], batch.num_source_blocks[rows],
                     batch.target_tables[rows, :count], batch.query_slots[rows],
                     batch.is_compressed[rows], params, SCALE)
    for name in ("k_cache", "v_cache", "score_cache"):
        assert torch.equal(getattr(together, name), getattr(alone, name))
    # Fewer targets than the widest request: the other requests' blocks beyond theirs are untouched.
    untouched = batch.source_tables[1, 2]
    assert torch.equal(together.k_cache[:, untouched], batch.k_cache[:, untouched])
    with pytest.raises(ValueError, match="request 1: 3 target blocks for 3 source blocks"):
        compress_ref(*batch.clone().arguments(params, SCALE),
                     num_target_blocks=torch.tensor([3, 3, 2], dtype=torch.int32))


@pytest.mark.parametrize("window", [0, 9, 24])
def test_a_window_beyond_half_a_block_is_rejected_like_the_config_does(window):
    with pytest.raises(ValueError) as error:
        CompressionParams(block_size=16, window=window)
    message = str(error.value)
    assert message == f"window: got {window}, expected an integer with 1 <= window <= block_size/2 = 8"
    with pytest.raises(ConfigError, match=message.split(", expected")[1].strip()):
        ZipageConfig(block_size=16, window=window, kv_budget=32)
    with pytest.raises(ValueError, match="^window: got"):
        replace(CompressionParams(block_size=16, window=8), window=window)


def test_reference_score_cache_follows_the_global_score_switch():
    batch = make_batch(torch.float32, group=1, block_size=16, window=4, seed=0)
    params = CompressionParams(block_size=16, window=4, global_score=False)
    untouched = batch.score_cache.clone()
    compress_ref(*batch.arguments(params, SCALE))
    assert torch.equal(batch.score_cache, untouched)
    with pytest.raises(ValueError, match="score_cache"):
        compress_ref(*replace(batch, score_cache=None).arguments(replace(params, global_score=True), SCALE))


# ---------------------------------------------------------------- random batches


LAYERS, KV_HEADS, HEAD_DIM, NUM_SLOTS = 2, 2, 64, 4
N_MAX = 3  # two target blocks per request


# One batch of the pipeline's inputs (the type the engine's compressor builds too).
Batch = CompressionInputs
SCALE = HEAD_DIM**-0.5


def make_batch(dtype: torch.dtype, group: int, block_size: int, window: int, seed: int,
               layers: int = LAYERS) -> Batch:
    """Three requests with ragged block counts (4, 3, 3) over a cache of random values (a kernel that reads a
    block it does not own gets a wrong answer, not a lucky zero), in random block order:

    - request 0 shares its first block with request 2 (a prefix); targets: a fresh block, then its own block 1
      at the same index (rule 5: read and written in place);
    - request 1 owns blocks 0 and 2 but block 1 (shared with request 2's last block) is not its own, so the
      core's targets are its own blocks in order: block 0 in place and block 2 moved up to target index 1, where
      in-place compaction would overwrite entries not yet read (the staged path);
    - request 2: a fresh block for the shared prefix block, then its own block 1.

    A quarter of the entries of each block copy another entry of the same block, and a few copy an entry of
    another block, plus noise (cosine similarity ~0.98, far above any threshold used, while random pairs sit
    near 0): the redundancy's threshold rule has work to do in both modes without sitting on a rounding edge.
    """
    generator = torch.Generator().manual_seed(seed)
    num_blocks = 20
    shape = (layers, num_blocks, block_size, KV_HEADS, HEAD_DIM)
    keys = torch.randn(shape, generator=generator)
    for _ in range(num_blocks * block_size // 4):
        layer, block, other_block = (int(value) for value in torch.randint(0, num_blocks, (3,), generator=generator))
        layer %= layers
        entry, copied = (int(value) for value in torch.randint(0, block_size, (2,), generator=generator))
        source_block = other_block if entry % 8 == 0 else block
        keys[layer, block, entry] = keys[layer, source_block, copied] + 0.2 * torch.randn(
            (KV_HEADS, HEAD_DIM), generator=generator)
    values = torch.randn(shape, generator=generator)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    shared_prefix, shared_middle = order[0], order[1]
    own = iter(order[2:])
    tables = [
        [shared_prefix] + [next(own) for _ in range(3)],
        [next(own), shared_middle, next(own)],
        [shared_prefix, next(own), shared_middle],
    ]
    targets = [[next(own), tables[0][1]], [tables[1][0], tables[1][2]], [next(own), tables[2][1]]]
    source_tables = torch.full((3, 4), -1, dtype=torch.int32)
    for row, table in enumerate(tables):
        source_tables[row, :len(table)] = torch.tensor(table, dtype=torch.int32)
    query_cache = torch.randn((layers, NUM_SLOTS, window, KV_HEADS * group, HEAD_DIM), generator=generator)
    # Global scores of the size of attention scores over ~64 entries, so the decayed max picks either side.
    score_cache = 0.03 * torch.rand(shape[:4], generator=generator)
    return Batch(
        k_cache=keys.to(dtype),
        v_cache=values.to(dtype),
        score_cache=score_cache.to(dtype),
        query_cache=query_cache.to(dtype),
        source_tables=source_tables,
        num_source_blocks=torch.tensor([len(table) for table in tables], dtype=torch.int32),
        target_tables=torch.tensor(targets, dtype=torch.int32),
        query_slots=torch.tensor([2, 0, 3], dtype=torch.int64),
        is_compressed=torch.tensor([seed % 2 == 0, True, False]),
    )


def reference_scores(batch: Batch, params: CompressionParams, scale: float = HEAD_DIM**-0.5):
    """The reference's (final scores, stored global scores) of every (layer, request), [Hkv, length] each."""
    results = {}
    for request, count in enumerate(batch.num_source_blocks.tolist()):
        source = batch.source_tables[request, :count].long()
        for layer in range(batch.k_cache.shape[0]):
            keys = batch.k_cache[layer, source].flatten(0, 1)
            previous = batch.score_cache[layer, source].flatten(0, 1).transpose(0, 1)
            results[layer, request] = final_scores(keys, batch.query_cache[layer, batch.query_slots[request]],
                                                   previous, bool(batch.is_compressed[request]), params, scale)
    return results


# ---------------------------------------------------------------- Triton, through the interpreter


@pytest.fixture(scope="module")
def triton_kernels():
    from zipage.kernels import compress_triton

    return compress_triton


class ChildProcesses:
    """The interpreter run and the Hopper compilation, both single-threaded, started together on first use so
    they run side by side."""

    def __init__(self) -> None:
        self.processes: dict[str, subprocess.Popen] = {}

    def start(self) -> None:
        interpreted = {**os.environ, "TRITON_INTERPRET": "1"}
        commands = {
            "interpreter": ([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"], interpreted),
            "hopper": ([sys.executable, __file__, HOPPER_COMMAND], compiler_environment()),
        }
        for name, (command, environment) in commands.items():
            self.processes[name] = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE,
                                                    stderr=subprocess.PIPE, text=True)

    def result(self, name: str) -> tuple[int, str, str]:
        if not self.processes:
            self.start()
        stdout, stderr = self.processes[name].communicate(timeout=600)
        return self.processes[name].returncode, stdout, stderr

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.communicate()


@pytest.fixture(scope="module")
def child_processes():
    children = ChildProcesses()
    yield children
    children.stop()


@pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")
@pytest.mark.skipif(UNDER_INTERPRETER, reason="this is the child process already")
def test_triton_kernels_under_the_interpreter(child_processes):
    returncode, stdout, stderr = child_processes.result("interpreter")
    assert returncode == 0, stdout[-6000:] + stderr[-2000:]


@pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")
@pytest.mark.skipif(UNDER_INTERPRETER, reason="the compiler needs Triton imported without the interpreter")
def test_kernels_compile_for_hopper(child_processes):
    returncode, _, stderr = child_processes.result("hopper")
    check_hopper_compilation(returncode, stderr)


# Constexprs of the compression kernels: fixed by the model and the config, never by a batch (a value that
# changes from batch to batch compiles a new variant mid-run: 19 compilations of up to 2.2 s in one elastic run).
DEPLOYMENT_CONSTEXPRS = {"NUM_KV_HEADS", "WINDOW", "GROUP", "WINDOW_PADDED", "GROUP_PADDED", "BLOCK_SIZE",
                         "HEAD_DIM", "HEAD_DIM_PADDED", "KEY_TILE", "DOT_PRECISION", "STATS_CHUNK", "GLOBAL_SCORE",
                         "TILE", "LIGHTNING", "POOLING", "POOL_RADIUS", "REDUNDANCY", "NUM_DIM_TILES", "TABLE_TILE",
                         "DIM_TILE", "ENTRY_TILE", "FP8"}
BATCH_SHAPE_ARGUMENTS = {"num_requests", "max_blocks", "keep_width", "source_table_stride",
                         "target_table_stride"}


@pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")
@pytest.mark.skipif(UNDER_INTERPRETER, reason="the interpreter's kernels keep no parameter list")
def test_no_kernel_compiles_anew_for_a_new_batch_shape():
    for kernel, _ in hopper_launches():
        for param in kernel.params:
            if param.is_constexpr:
                assert param.name in DEPLOYMENT_CONSTEXPRS, (kernel.fn.__name__, param.name)
            elif param.name in BATCH_SHAPE_ARGUMENTS:
                assert param.do_not_specialize, (kernel.fn.__name__, param.name)


def hopper_launches() -> list:
    """Every kernel with the constexpr values of one bfloat16 launch; small shapes keep the compilation quick
    (the interpreter ignores barriers, so this also checks the kernels that rely on them build)."""
    from zipage.kernels import compress_triton as kernels

    score = dict(NUM_KV_HEADS=8, WINDOW=16, GROUP=3, WINDOW_PADDED=16, GROUP_PADDED=4, BLOCK_SIZE=64,
                 HEAD_DIM=128, HEAD_DIM_PADDED=128, KEY_TILE=64, DOT_PRECISION="tf32")
    redundancy = dict(NUM_KV_HEADS=8, BLOCK_SIZE=64, HEAD_DIM=128, HEAD_DIM_PADDED=128, TILE=64,
                      DOT_PRECISION="tf32")
    compaction = dict(NUM_KV_HEADS=8, NUM_DIM_TILES=2, BLOCK_SIZE=64, HEAD_DIM=128, DIM_TILE=64,
                      ENTRY_TILE=64)
    return [
        (kernels._block_softmax_stats_kernel, score | dict(FP8=False)),
        (kernels._attention_score_kernel, score | dict(STATS_CHUNK=16, GLOBAL_SCORE=True, FP8=False)),
        (kernels._newest_similar_row_kernel, redundancy | dict(LIGHTNING=False)),
        (kernels._redundancy_kernel, redundancy | dict(LIGHTNING=True)),
        (kernels._final_score_kernel, dict(NUM_KV_HEADS=8, BLOCK_SIZE=64, WINDOW=16, POOLING=1, POOL_RADIUS=2,
                                           REDUNDANCY=True, TILE=1024)),
        (kernels._compact_in_place_kernel,
         compaction | dict(TABLE_TILE=16, GLOBAL_SCORE=True, FP8=False)),
        (kernels._compact_staged_kernel, compaction | dict(FP8=False)),
    ]


def hopper_fp8_launches() -> list:
    """The kernels that read FP8 keys (scores, redundancy) or move FP8 entries and their scales (compaction,
    whose caches are bytes), with FP8 on."""
    from zipage.kernels import compress_triton as kernels

    launches = hopper_launches()
    fp8 = [(kernel, constants | dict(FP8=True)) if "FP8" in constants else (kernel, constants)
           for kernel, constants in launches if kernel is not kernels._final_score_kernel]
    reads = [launch for launch in fp8 if launch[0] not in (kernels._compact_in_place_kernel,
                                                           kernels._compact_staged_kernel)]
    moves = [launch for launch in fp8 if launch not in reads]
    return reads, moves


def fp8_argument_type(cache_type: str):
    types = POINTER_TYPES | {"k_cache_ptr": cache_type, "v_cache_ptr": cache_type, "k_scratch_ptr": cache_type,
                             "v_scratch_ptr": cache_type}
    types |= {name: "*fp32" for name in ("k_scale_ptr", "v_scale_ptr", "k_scale_scratch_ptr", "v_scale_scratch_ptr")}
    return lambda name: types.get(name, "fp32" if name in FLOAT_ARGUMENTS else "i32")


POINTER_TYPES = {name: "*bf16" for name in ("query_cache_ptr", "k_cache_ptr", "v_cache_ptr", "score_cache_ptr",
                                            "k_scratch_ptr", "v_scratch_ptr")}
POINTER_TYPES |= {name: "*fp32" for name in ("block_max_ptr", "block_sum_ptr", "scores_ptr", "redundancy_ptr",
                                             "final_ptr")}
POINTER_TYPES |= {name: "*i32" for name in ("source_tables_ptr", "num_source_blocks_ptr", "target_tables_ptr",
                                            "num_target_blocks_ptr", "newest_ptr", "staging_count_ptr")}
POINTER_TYPES |= {name: "*i64" for name in ("query_slots_ptr", "kept_ptr", "staging_queue_ptr")}
POINTER_TYPES |= {"is_compressed_ptr": "*i1"}
POINTER_TYPES |= {name: "*fp32" for name in ("k_scale_ptr", "v_scale_ptr", "k_scale_scratch_ptr",
                                             "v_scale_scratch_ptr")}
FLOAT_ARGUMENTS = {"qk_scale", "alpha", "threshold", "tau", "lambda_weight"}


def argument_type(name: str) -> str:
    return POINTER_TYPES.get(name, "fp32" if name in FLOAT_ARGUMENTS else "i32")


TRITON_CASES = [
    # (dtype, group, block size, redundancy, pooling, global score, small tiles)
    (torch.float32, 1, 16, "lightning", "first", True, False),
    (torch.float32, 3, 32, "flash", "always", True, False),
    (torch.float32, 8, 16, "off", "off", False, False),
    (torch.float16, 3, 32, "lightning", "off", True, True),
    (torch.float16, 8, 32, "flash", "first", False, False),
    (torch.float16, 1, 16, "off", "always", True, True),
]
# Tiles smaller than a block and than a sequence, so every loop of every kernel runs more than once: several key
# tiles per block, several row/column tiles per block (lightning's backward walk), softmax statistics merged over
# several chunks, several final-score tiles, several compaction chunks and head-dim slices. These cases use one
# layer (the interpreter's time grows with the number of programs); the others batch two.
SMALL_TILES = dict(_SCORE_KEY_TILE=16, _REDUNDANCY_TILE=16, _STATS_CHUNK=2, _FINAL_TILE=32,
                   _COMPACTION_ENTRIES=16, _COMPACTION_DIM_TILE=32)
# Final scores are float32 sums of a few hundred terms of size ~1e-2 (exp2 instead of exp, a product by
# 1 / sum instead of a division, the norm applied after the dot instead of before): 1e-6 covers it.
SCORE_TOLERANCE = dict(atol=1e-6, rtol=1e-5)


def kept_sets_agree_up_to_ties(kept: torch.Tensor, final: torch.Tensor, keep: int, where: tuple) -> bool:
    """Whether Triton's kept sets (per KV head) equal the reference's; asserts that any difference lies at
    the keep-th score (a tie within float tolerance)."""
    kept_reference = kept_entries(final, keep)
    agree = True
    for head in range(KV_HEADS):
        differing = set(kept[head].tolist()) ^ set(kept_reference[head].tolist())
        if differing:
            agree = False
            cut = final[head].topk(keep).values[-1]
            near_cut = (final[head, sorted(differing)] - cut).abs() <= 1e-6 + 1e-5 * cut.abs()
            assert torch.all(near_cut), (*where, head, sorted(differing))
    return agree


@under_interpreter
@pytest.mark.parametrize("dtype,group,block_size,redundancy,pooling,global_score,small_tiles", TRITON_CASES)
def test_pipeline_matches_reference(triton_kernels, monkeypatch, dtype, group, block_size, redundancy, pooling,
                                    global_score, small_tiles):
    if small_tiles:
        for name, value in SMALL_TILES.items():
            monkeypatch.setattr(triton_kernels, name, value)
    window = 4
    params = CompressionParams(block_size=block_size, window=window, redundancy=redundancy, pooling=pooling,
                               global_score=global_score)
    batch = make_batch(dtype, group, block_size, window, seed=group * block_size, layers=1 if small_tiles else LAYERS)
    keep = batch.target_tables.shape[1] * block_size
    # Record what compress_triton computes on the way: its final and stored scores and its kept sets.
    recorded = {}
    scores_function, compact_function = triton_kernels.compression_scores_triton, triton_kernels.compact_triton

    def record_scores(*arguments):
        recorded["final"], recorded["scores"] = scores_function(*arguments)
        return recorded["final"], recorded["scores"]

    def record_compaction(*arguments):
        recorded["kept"] = arguments[6]
        return compact_function(*arguments)

    monkeypatch.setattr(triton_kernels, "compression_scores_triton", record_scores)
    monkeypatch.setattr(triton_kernels, "compact_triton", record_compaction)
    result = batch.clone()
    triton_kernels.compress_triton(*result.arguments(params, SCALE))

    expected = reference_scores(batch, params)
    from_kept = batch.clone()  # the reference compaction applied to Triton's kept sets
    all_agree = True
    for (layer, request), (final, stored) in expected.items():
        length = final.shape[1]
        final_triton = recorded["final"][layer, request]
        assert torch.all(final_triton[:, length:] == float("-inf"))
        final_triton = final_triton[:, :length]
        assert torch.equal(torch.isinf(final_triton), torch.isinf(final))
        finite = torch.isfinite(final)
        torch.testing.assert_close(final_triton[finite], final[finite], **SCORE_TOLERANCE)
        if global_score:
            torch.testing.assert_close(recorded["scores"][layer, request, :, :length], stored, **SCORE_TOLERANCE)
        kept = recorded["kept"][layer, request]
        all_agree &= kept_sets_agree_up_to_ties(kept, final, keep, (layer, request))
        source = batch.source_tables[request, :batch.num_source_blocks[request]].long()
        write_kept_entries(from_kept.k_cache[layer], from_kept.v_cache[layer],
                           from_kept.score_cache[layer] if global_score else None, source,
                           batch.target_tables[request].long(), kept,
                           recorded["scores"][layer, request, :, :length])
    assert torch.equal(result.k_cache, from_kept.k_cache)
    assert torch.equal(result.v_cache, from_kept.v_cache)
    assert torch.equal(result.score_cache, from_kept.score_cache)
    if all_agree:
        reference = batch.clone()
        compress_ref(*reference.arguments(params, SCALE))
        assert torch.equal(result.k_cache, reference.k_cache)
        assert torch.equal(result.v_cache, reference.v_cache)
        torch.testing.assert_close(result.score_cache, reference.score_cache, **SCORE_TOLERANCE)


@under_interpreter
@pytest.mark.parametrize("redundancy,pooling,global_score", [("lightning", "first", True),
                                                             ("flash", "off", False)])
def test_pipeline_with_a_target_count_per_request_matches_reference(triton_kernels, monkeypatch, redundancy,
                                                                    pooling, global_score):
    """Requests keeping different numbers of blocks in one batch (3, 1, 2 of the ragged table), float32: each
    request's kept set is its own top k_r (differences only at ties with its k_r-th score), Triton writes
    exactly what the reference compaction writes from those kept sets, and what `compress_ref` writes when the
    kept sets agree."""
    params = CompressionParams(block_size=16, window=4, redundancy=redundancy, pooling=pooling,
                               global_score=global_score)
    batch = ragged(make_batch(torch.float32, group=3, block_size=16, window=4, seed=11))
    recorded = {}
    compact_function = triton_kernels.compact_triton

    def record_compaction(*arguments):
        recorded["kept"], recorded["scores"] = arguments[6], arguments[7]
        return compact_function(*arguments)

    monkeypatch.setattr(triton_kernels, "compact_triton", record_compaction)
    result = batch.clone()
    triton_kernels.compress_triton(*result.arguments(params, SCALE), num_target_blocks=result.num_target_blocks)
    expected = reference_scores(batch, params)
    from_kept = batch.clone()
    all_agree = True
    for (layer, request), (final, _) in expected.items():
        count = int(batch.num_target_blocks[request])
        keep = count * params.block_size
        kept = recorded["kept"][layer, request, :, :keep]
        all_agree &= kept_sets_agree_up_to_ties(kept, final, keep, (layer, request))
        source = batch.source_tables[request, :batch.num_source_blocks[request]].long()
        write_kept_entries(from_kept.k_cache[layer], from_kept.v_cache[layer],
                           from_kept.score_cache[layer] if global_score else None, source,
                           batch.target_tables[request, :count].long(), kept,
                           recorded["scores"][layer, request, :, :final.shape[1]])
    for name in ("k_cache", "v_cache", "score_cache"):
        assert torch.equal(getattr(result, name), getattr(from_kept, name)), name
    if all_agree:
        reference = batch.clone()
        compress_ref(*reference.arguments(params, SCALE), num_target_blocks=reference.num_target_blocks)
        assert torch.equal(result.k_cache, reference.k_cache)
        assert torch.equal(result.v_cache, reference.v_cache)
        torch.testing.assert_close(result.score_cache, reference.score_cache, **SCORE_TOLERANCE)
    # Request 1 keeps one block: its block 2 (a source, not a target) is left as it was.
    untouched = batch.source_tables[1, 2]
    assert torch.equal(result.k_cache[:, untouched], batch.k_cache[:, untouched])


@under_interpreter
def test_ties_go_to_the_lowest_position_in_triton_as_in_the_reference(triton_kernels, monkeypatch):
    """All keys zero: every entry outside the window gets the same attention score (exactly, on both
    sides), so the kept set is the window plus the lowest positions, for every (layer, request, head)."""
    params = CompressionParams(block_size=16, window=4, redundancy="off", pooling="off",
                               global_score=False)
    batch = make_batch(torch.float32, group=3, block_size=16, window=4, seed=1)
    batch.k_cache.zero_()
    keep = batch.target_tables.shape[1] * params.block_size
    recorded = {}
    compact_function = triton_kernels.compact_triton

    def record_compaction(*arguments):
        recorded["kept"] = arguments[6]
        return compact_function(*arguments)

    monkeypatch.setattr(triton_kernels, "compact_triton", record_compaction)
    result = batch.clone()
    triton_kernels.compress_triton(*result.arguments(params, SCALE))
    reference = batch.clone()
    compress_ref(*reference.arguments(params, SCALE))
    for request, count in enumerate(batch.num_source_blocks.tolist()):
        length = count * params.block_size
        expected = list(range(keep - params.window)) + list(range(length - params.window, length))
        for layer in range(LAYERS):
            assert recorded["kept"][layer, request].tolist() == [expected] * KV_HEADS
    assert torch.equal(result.k_cache, reference.k_cache)
    assert torch.equal(result.v_cache, reference.v_cache)


@under_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_compaction_in_place_and_staged(triton_kernels, dtype):
    """Random kept sets moved by the compaction kernels, against the reference compaction: in-place targets
    (same index, earlier index, fresh) and a target that is a later source (queued to the staged kernel), with
    several requests staged at once so the staged programs take turns over the queue."""
    generator = torch.Generator().manual_seed(5)
    block_size, num_blocks, requests = 16, 24, 4
    shape = (LAYERS, num_blocks, block_size, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    score_cache = torch.rand(shape[:4], generator=generator).to(dtype)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = [order[0:4], order[4:8], order[8:12], order[12:16]]
    fresh = order[16:]
    targets = [
        [tables[0][0], tables[0][1], tables[0][2]],  # in place, same index
        [fresh[0], tables[1][0], tables[1][1]],  # own blocks at later target indices: in place is still safe
        [tables[2][0], tables[2][3], fresh[1]],  # source 3 -> target 1: staged
        [tables[3][2], fresh[2], tables[3][1]],  # source 2 -> target 0: staged
    ]
    keep = 3 * block_size
    kept = torch.stack([torch.randperm(4 * block_size, generator=generator)[:keep].sort().values
                        for _ in range(LAYERS * requests * KV_HEADS)]).view(LAYERS, requests, KV_HEADS, keep)
    scores = torch.rand((LAYERS, requests, KV_HEADS, 4 * block_size), generator=generator)
    source_tables = torch.tensor(tables, dtype=torch.int32)
    target_tables = torch.tensor(targets, dtype=torch.int32)
    caches = [tensor.clone() for tensor in (k_cache, v_cache, score_cache)]
    triton_kernels.compact_triton(*caches, source_tables, torch.full((requests,), 4, dtype=torch.int32),
                                  target_tables, kept, scores, True)
    for layer in range(LAYERS):
        for request in range(requests):
            write_kept_entries(k_cache[layer], v_cache[layer], score_cache[layer], source_tables[request].long(),
                               target_tables[request].long(), kept[layer, request], scores[layer, request])
    for result, expected in zip(caches, (k_cache, v_cache, score_cache)):
        assert torch.equal(result, expected)


@under_interpreter
def test_dispatch_uses_reference_for_cpu_tensors_unless_interpreted(triton_kernels, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    calls = []
    monkeypatch.setattr(triton_kernels, "compress_triton",
                        lambda *arguments, **keywords: calls.append(arguments))
    params = CompressionParams(block_size=16, window=4)
    reference_batch = make_batch(torch.float32, group=1, block_size=16, window=4, seed=2)
    dispatched_batch = reference_batch.clone()
    compress_ref(*reference_batch.arguments(params, SCALE))
    compress_module.compress(*dispatched_batch.arguments(params, SCALE))
    assert not calls
    assert torch.equal(dispatched_batch.k_cache, reference_batch.k_cache)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # forces Triton on CPU tensors
    compress_module.compress(*dispatched_batch.arguments(params, SCALE))
    assert len(calls) == 1


# ---------------------------------------------------------------- FP8 KV cache (docs/kernels.md, 'FP8 KV cache')


def fp8_batch(batch: Batch) -> tuple[Batch, Batch]:
    """(the batch with its K and V quantized to fp8 + scales, the same batch with those values dequantized, in
    float32: the oracle's keys are exactly what the kernels read)."""
    k_values, k_scale = quantize_kv(batch.k_cache.float() * (1 + 10 * (torch.arange(HEAD_DIM) == 2)))
    v_values, v_scale = quantize_kv(batch.v_cache.float())
    fp8 = replace(batch, k_cache=k_values, v_cache=v_values, k_scale=k_scale, v_scale=v_scale)
    dense = replace(batch, k_cache=dequantize_kv(k_values, k_scale), v_cache=dequantize_kv(v_values, v_scale))
    return fp8.clone(), dense.clone()


@under_interpreter
@pytest.mark.parametrize("dtype,group,block_size,redundancy,pooling", [
    (torch.float32, 3, 16, "lightning", "first"),
    (torch.float32, 1, 32, "flash", "always"),
    (torch.float16, 8, 16, "lightning", "off"),
])
def test_pipeline_on_fp8_matches_reference(triton_kernels, monkeypatch, dtype, group, block_size, redundancy,
                                           pooling):
    """The scores read fp8 keys with their scales (the redundancy without: a cosine does not see them), the
    compaction moves fp8 bytes and scales, in place and staged (make_batch's request 1)."""
    params = CompressionParams(block_size=block_size, window=4, redundancy=redundancy, pooling=pooling)
    fp8, dense = fp8_batch(make_batch(dtype, group, block_size, 4, seed=group + block_size))
    keep = fp8.target_tables.shape[1] * block_size
    recorded = {}
    scores_function, compact_function = triton_kernels.compression_scores_triton, triton_kernels.compact_triton

    def record_scores(*arguments):
        recorded["final"], recorded["scores"] = scores_function(*arguments)
        return recorded["final"], recorded["scores"]

    def record_compaction(*arguments):
        recorded["kept"] = arguments[6]
        return compact_function(*arguments)

    monkeypatch.setattr(triton_kernels, "compression_scores_triton", record_scores)
    monkeypatch.setattr(triton_kernels, "compact_triton", record_compaction)
    result = fp8.clone()
    triton_kernels.compress_triton(*result.arguments(params, SCALE), **result.keywords())
    # The reference's scores on the dequantized keys in float32 (float16 queries are exact in float32).
    expected = reference_scores(replace(dense, query_cache=dense.query_cache.float()), params)
    tolerance = SCORE_TOLERANCE
    from_kept = fp8.clone()
    all_agree = True
    for (layer, request), (final, stored) in expected.items():
        length = final.shape[1]
        final_triton = recorded["final"][layer, request, :, :length]
        finite = torch.isfinite(final)
        assert torch.equal(torch.isinf(final_triton), torch.isinf(final))
        torch.testing.assert_close(final_triton[finite], final[finite], **tolerance)
        torch.testing.assert_close(recorded["scores"][layer, request, :, :length], stored, **tolerance)
        kept = recorded["kept"][layer, request]
        all_agree &= kept_sets_agree_up_to_ties(kept, final, keep, (layer, request))
        source = fp8.source_tables[request, :fp8.num_source_blocks[request]].long()
        write_kept_entries(from_kept.k_cache[layer], from_kept.v_cache[layer], from_kept.score_cache[layer], source,
                           fp8.target_tables[request].long(), kept, recorded["scores"][layer, request, :, :length],
                           k_scale=from_kept.k_scale[layer], v_scale=from_kept.v_scale[layer])
    # Moves, not arithmetic: the bytes and the scales are the reference compaction's exactly.
    assert torch.equal(result.k_cache.view(torch.uint8), from_kept.k_cache.view(torch.uint8))
    assert torch.equal(result.v_cache.view(torch.uint8), from_kept.v_cache.view(torch.uint8))
    assert torch.equal(result.k_scale.view(torch.int32), from_kept.k_scale.view(torch.int32))
    assert torch.equal(result.v_scale.view(torch.int32), from_kept.v_scale.view(torch.int32))
    if all_agree:
        reference = fp8.clone()
        compress_ref(*reference.arguments(params, SCALE), **reference.keywords())
        assert torch.equal(result.k_cache.view(torch.uint8), reference.k_cache.view(torch.uint8))
        assert torch.equal(result.k_scale.view(torch.int32), reference.k_scale.view(torch.int32))


@under_interpreter
def test_fp8_needs_both_scales(triton_kernels):
    fp8, _ = fp8_batch(make_batch(torch.float32, 1, 16, 4, seed=0))
    params = CompressionParams(block_size=16, window=4)
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        triton_kernels.compress_triton(*fp8.arguments(params, SCALE), k_scale=fp8.k_scale)


def _compile_all_for_hopper() -> int:
    reads, moves = hopper_fp8_launches()
    return (compile_for_hopper(hopper_launches, argument_type)
            or compile_for_hopper(lambda: reads, fp8_argument_type("*fp8e4nv"))
            or compile_for_hopper(lambda: moves, fp8_argument_type("*u8")))


if __name__ == "__main__" and sys.argv[1:] == [HOPPER_COMMAND]:
    sys.exit(_compile_all_for_hopper())
