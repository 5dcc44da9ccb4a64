"""Triton kernels of the compression pipeline (docs/architecture.md, 'Compression pipeline'),
batched over a group of layers, the requests
of a compression batch and the KV heads.

Same arguments and semantics as ``compress_ref.compress_ref`` (the oracle the tests compare against). One call
runs, for L layers x R requests x Hkv KV heads at once (step numbers of docs/architecture.md, 'Compression pipeline'):

- steps 1-2: ``_block_softmax_stats_kernel`` and ``_attention_score_kernel`` — the window queries' softmax over
  the paged keys, flash-style without storing logits: the first pass keeps, per source block, the running max and
  sum of every query row; the second recomputes each tile's logits, normalises them with the statistics merged
  over all blocks, takes the max over the group's query heads and the mean over the window, and folds in the
  decayed global score. Output: S, float32 ``[L, R, Hkv, max_blocks * b]``;
- step 4: ``_newest_similar_row_kernel`` and ``_redundancy_kernel`` — the redundancy score in two passes over
  tiles of the cosine-similarity matrix, never storing it: per column, the newest row above the threshold; then
  per row, the sum of its similarities without those entries. "lightning" compares within a block, "flash" all
  pairs;
- steps 3, 4 (the softmax) and 5: ``_final_score_kernel`` — pooling, the redundancy softmax, the weighted
  difference, +inf for the window and -inf for padding, one program per (layer, request, KV head);
- step 6: the top k of the padded final scores, ties to the lowest position (``compress_ref.kept_entries``);
- step 7: ``_compact_in_place_kernel`` (and ``_compact_staged_kernel`` where in place would be unsafe) — the kept
  K, V and global-score entries written densely, in order, into the target blocks.

Nothing is read back to the host, so an asynchronous compression on its own stream never stalls the CPU thread
that launches decode steps. All offsets into the caches are int64 (a layer group's cache exceeds 2^31 elements).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zipage.kernels.compress_ref import CompressionParams, batch_kept_entries

_LOG2_E = 1.4426950408889634
# tl.dot on tensor cores needs every dimension to be at least 16.
_MIN_DOT_DIM = 16
# Keys per tile of the attention-score kernels and rows/columns per tile of the redundancy kernels (capped by the
# block size, so a tile never straddles two blocks and its keys share one block-table lookup).
_SCORE_KEY_TILE = 64
_REDUNDANCY_TILE = 64
# Blocks whose softmax statistics the score kernel merges per iteration.
_STATS_CHUNK = 16
# Sequence entries per iteration of the final-score kernel.
_FINAL_TILE = 1024
# Kept entries moved per iteration of the compaction, and head-dim elements per compaction program (splitting the
# head dim gives a one-request batch more programs; every element is moved independently).
_COMPACTION_ENTRIES = 64
_COMPACTION_DIM_TILE = 64
# Programs (each with a private scratch of keep_width x DIM_TILE entries for K and V) of the staged compaction.
_STAGING_PROGRAMS = 32
_INTERPRETER_STAGING_PROGRAMS = 2
# Triton compiles a variant per integer argument equal to 1 or divisible by 16; for the batch's request count and
# table width that would mean compilations in the middle of serving, whenever a new batch shape shows up.
_BATCH_SHAPE_ARGUMENTS = ["num_requests", "max_blocks"]
# The padded block tables' row strides are their widths: the batch's longest source table and widest target.
_TABLE_ARGUMENTS = [*_BATCH_SHAPE_ARGUMENTS, "source_table_stride"]
# The compaction's width is the batch's widest target count: one value under a fixed budget, a new one for almost
# every batch with per-request or elastic budgets. As a constexpr (with the table widths padded to powers of two)
# it cost a compilation of up to 2.2 s, 19 times in one H200 run with elastic budgets; so the compaction
# kernels take the width, and walk the block tables in tiles, with runtime bounds. (The table strides are not
# specialised either: a width of 16 or 32 blocks compiled every kernel anew, 1.8 s.)
_COMPACTION_TABLE_TILE = 16
_POOLING_MODES = {"off": 0, "first": 1, "always": 2}
_REDUNDANCY_MODES = ("lightning", "flash", "off")


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs would otherwise run as tf32 on the GPU and differ from the reference by ~1e-3. Half-precision
    # inputs multiply exactly into float32 accumulators, as the reference's upcast does.
    return "ieee" if dtype == torch.float32 else "tf32"


def _padded_dim(size: int) -> int:
    return max(triton.next_power_of_2(size), _MIN_DOT_DIM)


@triton.jit
def _load_window_queries(
    query_cache_ptr,
    query_base,
    kv_head,
    query_window_stride,
    query_head_stride,
    WINDOW: tl.constexpr,
    GROUP: tl.constexpr,
    WINDOW_PADDED: tl.constexpr,
    GROUP_PADDED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
):
    """The w window queries of the group's query heads as the rows of one matrix: row ``u * GROUP_PADDED + g`` is
    window query u of query head ``kv_head * GROUP + g``, so each key tile serves the whole group in one product.
    Padding rows are zero and flagged invalid."""
    rows = tl.arange(0, WINDOW_PADDED * GROUP_PADDED)
    window_rows = rows // GROUP_PADDED
    group_rows = rows % GROUP_PADDED
    row_valid = (window_rows < WINDOW) & (group_rows < GROUP)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    offsets = query_base + window_rows[:, None] * query_window_stride + dims[None, :]
    offsets += (kv_head * GROUP + group_rows)[:, None] * query_head_stride
    queries = tl.load(query_cache_ptr + offsets, mask=row_valid[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
    return queries, window_rows, row_valid


@triton.jit
def _block_tile_logits(
    queries,
    window_rows,
    k_cache_ptr,
    block_base,
    tile_start,
    is_final_block,
    qk_scale,
    cache_slot_stride,
    k_scale_ptr,
    scale_block_base,
    scale_slot_stride,
    BLOCK_SIZE: tl.constexpr,
    WINDOW: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    KEY_TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
):
    """Base-2 logits ``[rows, KEY_TILE]`` of the window queries against keys ``tile_start ..`` of one block. An FP8
    cache's keys are widened to the queries' dtype (exact) and their scales multiply the logits' columns."""
    offsets = tile_start + tl.arange(0, KEY_TILE)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    key_offsets = block_base + offsets[:, None] * cache_slot_stride + dims[None, :]
    keys = tl.load(k_cache_ptr + key_offsets, mask=(dims < HEAD_DIM)[None, :], other=0.0)
    if FP8:
        keys = keys.to(queries.dtype)
    logits = tl.dot(queries, tl.trans(keys), input_precision=DOT_PRECISION) * qk_scale
    if FP8:
        logits = logits * tl.load(k_scale_ptr + scale_block_base + offsets * scale_slot_stride)[None, :]
    # Window query u sits at in-block offset b - w + u of the final block and sees offsets <= it.
    last_visible = tl.where(is_final_block, BLOCK_SIZE - WINDOW + window_rows, BLOCK_SIZE)
    return tl.where(offsets[None, :] <= last_visible[:, None], logits, float("-inf"))


@triton.jit(do_not_specialize=_TABLE_ARGUMENTS)
def _block_softmax_stats_kernel(
    query_cache_ptr,
    k_cache_ptr,
    source_tables_ptr,
    num_source_blocks_ptr,
    query_slots_ptr,
    block_max_ptr,
    block_sum_ptr,
    qk_scale,
    num_requests,
    max_blocks,
    query_layer_stride,
    query_slot_stride,
    query_window_stride,
    query_head_stride,
    cache_layer_stride,
    cache_block_stride,
    cache_slot_stride,
    cache_head_stride,
    source_table_stride,
    k_scale_ptr,
    scale_layer_stride,
    scale_block_stride,
    scale_slot_stride,
    NUM_KV_HEADS: tl.constexpr,
    WINDOW: tl.constexpr,
    GROUP: tl.constexpr,
    WINDOW_PADDED: tl.constexpr,
    GROUP_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    KEY_TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
):
    """Grid (max_blocks, L * R, Hkv): per source block, each query row's max logit and sum of 2^(logit - max)."""
    block_index = tl.program_id(0)
    layer_request = tl.program_id(1)
    kv_head = tl.program_id(2)
    layer = (layer_request // num_requests).to(tl.int64)
    request = layer_request % num_requests
    num_blocks = tl.load(num_source_blocks_ptr + request)
    if block_index < num_blocks:
        slot = tl.load(query_slots_ptr + request).to(tl.int64)
        queries, window_rows, row_valid = _load_window_queries(
            query_cache_ptr,
            layer * query_layer_stride + slot * query_slot_stride,
            kv_head,
            query_window_stride,
            query_head_stride,
            WINDOW,
            GROUP,
            WINDOW_PADDED,
            GROUP_PADDED,
            HEAD_DIM,
            HEAD_DIM_PADDED,
        )
        block_id = tl.load(source_tables_ptr + request * source_table_stride + block_index).to(tl.int64)
        block_base = layer * cache_layer_stride + block_id * cache_block_stride + kv_head * cache_head_stride
        scale_block_base = layer * scale_layer_stride + block_id * scale_block_stride + kv_head
        is_final_block = block_index == num_blocks - 1
        running_max = tl.full([WINDOW_PADDED * GROUP_PADDED], float("-inf"), tl.float32)
        running_sum = tl.zeros([WINDOW_PADDED * GROUP_PADDED], tl.float32)
        for tile_start in range(0, BLOCK_SIZE, KEY_TILE):
            logits = _block_tile_logits(
                queries,
                window_rows,
                k_cache_ptr,
                block_base,
                tile_start,
                is_final_block,
                qk_scale,
                cache_slot_stride,
                k_scale_ptr,
                scale_block_base,
                scale_slot_stride,
                BLOCK_SIZE,
                WINDOW,
                HEAD_DIM,
                HEAD_DIM_PADDED,
                KEY_TILE,
                DOT_PRECISION,
                FP8,
            )
            new_max = tl.maximum(running_max, tl.max(logits, axis=1))
            # With a wide window a row may see nothing of a tile of the final block: its sum stays zero.
            finite_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            running_sum = running_sum * tl.exp2(running_max - finite_max)
            running_sum += tl.sum(tl.exp2(logits - finite_max[:, None]), axis=1)
            running_max = new_max
        rows = tl.arange(0, WINDOW_PADDED * GROUP_PADDED)
        stats_offsets = ((layer_request * NUM_KV_HEADS + kv_head).to(tl.int64) * max_blocks + block_index) * (
            WINDOW_PADDED * GROUP_PADDED
        ) + rows
        tl.store(block_max_ptr + stats_offsets, running_max)
        tl.store(block_sum_ptr + stats_offsets, running_sum)


@triton.jit(do_not_specialize=_TABLE_ARGUMENTS)
def _attention_score_kernel(
    query_cache_ptr,
    k_cache_ptr,
    score_cache_ptr,
    source_tables_ptr,
    num_source_blocks_ptr,
    query_slots_ptr,
    is_compressed_ptr,
    block_max_ptr,
    block_sum_ptr,
    scores_ptr,
    qk_scale,
    alpha,
    num_requests,
    max_blocks,
    query_layer_stride,
    query_slot_stride,
    query_window_stride,
    query_head_stride,
    cache_layer_stride,
    cache_block_stride,
    cache_slot_stride,
    cache_head_stride,
    score_layer_stride,
    score_block_stride,
    score_slot_stride,
    score_head_stride,
    source_table_stride,
    k_scale_ptr,
    scale_layer_stride,
    scale_block_stride,
    scale_slot_stride,
    NUM_KV_HEADS: tl.constexpr,
    WINDOW: tl.constexpr,
    GROUP: tl.constexpr,
    WINDOW_PADDED: tl.constexpr,
    GROUP_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    KEY_TILE: tl.constexpr,
    STATS_CHUNK: tl.constexpr,
    GLOBAL_SCORE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
):
    """Grid (max_blocks, L * R, Hkv): the attention score of one source block's entries, merged with the decayed
    global score for every block but the last of a compressed request."""
    block_index = tl.program_id(0)
    layer_request = tl.program_id(1)
    kv_head = tl.program_id(2)
    layer = (layer_request // num_requests).to(tl.int64)
    request = layer_request % num_requests
    num_blocks = tl.load(num_source_blocks_ptr + request)
    if block_index < num_blocks:
        rows = tl.arange(0, WINDOW_PADDED * GROUP_PADDED)
        # Softmax statistics over the whole sequence, merged from the per-block ones: every row sees entry 0, so
        # the merged max is finite after the first chunk.
        item = (layer_request * NUM_KV_HEADS + kv_head).to(tl.int64)
        chunk = tl.arange(0, STATS_CHUNK)
        row_max = tl.full([WINDOW_PADDED * GROUP_PADDED], float("-inf"), tl.float32)
        row_sum = tl.zeros([WINDOW_PADDED * GROUP_PADDED], tl.float32)
        for chunk_start in range(0, num_blocks, STATS_CHUNK):
            blocks = chunk_start + chunk
            stats_offsets = (item * max_blocks + blocks)[:, None] * (WINDOW_PADDED * GROUP_PADDED) + rows[None, :]
            used = (blocks < num_blocks)[:, None]
            block_max = tl.load(block_max_ptr + stats_offsets, mask=used, other=float("-inf"))
            block_sum = tl.load(block_sum_ptr + stats_offsets, mask=used, other=0.0)
            new_max = tl.maximum(row_max, tl.max(block_max, axis=0))
            row_sum = row_sum * tl.exp2(row_max - new_max)
            row_sum += tl.sum(block_sum * tl.exp2(block_max - new_max[None, :]), axis=0)
            row_max = new_max

        slot = tl.load(query_slots_ptr + request).to(tl.int64)
        queries, window_rows, row_valid = _load_window_queries(
            query_cache_ptr,
            layer * query_layer_stride + slot * query_slot_stride,
            kv_head,
            query_window_stride,
            query_head_stride,
            WINDOW,
            GROUP,
            WINDOW_PADDED,
            GROUP_PADDED,
            HEAD_DIM,
            HEAD_DIM_PADDED,
        )
        # Padding rows get weight zero: they can neither win the max over the group nor add to the window mean.
        row_weight = tl.where(row_valid, 1.0 / row_sum, 0.0)
        block_id = tl.load(source_tables_ptr + request * source_table_stride + block_index).to(tl.int64)
        block_base = layer * cache_layer_stride + block_id * cache_block_stride + kv_head * cache_head_stride
        scale_block_base = layer * scale_layer_stride + block_id * scale_block_stride + kv_head
        is_final_block = block_index == num_blocks - 1
        # A compressed request's entries before its final block carry scores from earlier compressions.
        decays = (tl.load(is_compressed_ptr + request) != 0) & (block_index < num_blocks - 1)
        decayed_entries = tl.where(decays, BLOCK_SIZE, 0)
        score_block_base = layer * score_layer_stride + block_id * score_block_stride + kv_head * score_head_stride
        scores_row = item * max_blocks * BLOCK_SIZE + block_index * BLOCK_SIZE
        for tile_start in range(0, BLOCK_SIZE, KEY_TILE):
            logits = _block_tile_logits(
                queries,
                window_rows,
                k_cache_ptr,
                block_base,
                tile_start,
                is_final_block,
                qk_scale,
                cache_slot_stride,
                k_scale_ptr,
                scale_block_base,
                scale_slot_stride,
                BLOCK_SIZE,
                WINDOW,
                HEAD_DIM,
                HEAD_DIM_PADDED,
                KEY_TILE,
                DOT_PRECISION,
                FP8,
            )
            probabilities = tl.exp2(logits - row_max[:, None]) * row_weight[:, None]
            per_group = tl.reshape(probabilities, (WINDOW_PADDED, GROUP_PADDED, KEY_TILE))
            scores = tl.sum(tl.max(per_group, axis=1), axis=0) / WINDOW
            offsets = tile_start + tl.arange(0, KEY_TILE)
            if GLOBAL_SCORE:
                previous = tl.load(
                    score_cache_ptr + score_block_base + offsets * score_slot_stride,
                    mask=offsets < decayed_entries,
                    other=0.0,
                ).to(tl.float32)
                scores = tl.where(decays, tl.maximum(alpha * previous, scores), scores)
            tl.store(scores_ptr + scores_row + offsets, scores)


@triton.jit
def _sequence_key_tile(
    k_cache_ptr,
    head_base,
    source_row_ptr,
    tile_start,
    cache_block_stride,
    cache_slot_stride,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
):
    """Keys ``tile_start .. tile_start + TILE - 1`` of a request's sequence (all in one block) and their L2 norms,
    floored at 1e-12 as ``torch.nn.functional.normalize`` does."""
    block_id = tl.load(source_row_ptr + tile_start // BLOCK_SIZE).to(tl.int64)
    offsets = tile_start % BLOCK_SIZE + tl.arange(0, TILE)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    key_offsets = head_base + block_id * cache_block_stride + offsets[:, None] * cache_slot_stride + dims[None, :]
    keys = tl.load(k_cache_ptr + key_offsets, mask=(dims < HEAD_DIM)[None, :], other=0.0)
    if k_cache_ptr.dtype.element_ty == tl.float8e4nv:
        # FP8 keys: a cosine similarity does not see a key's positive scale, so the raw values serve, widened
        # (exactly) to float16 for the product.
        keys = keys.to(tl.float16)
    upcast = keys.to(tl.float32)
    norms = tl.maximum(tl.sqrt(tl.sum(upcast * upcast, axis=1)), 1e-12)
    return keys, norms


@triton.jit
def _cosine_similarity(row_keys, row_norms, rows, column_keys, column_norms, columns, DOT_PRECISION: tl.constexpr):
    """Cosine similarities ``[rows, columns]``: the raw product (exact products, float32 sums) over the norms.
    The diagonal reads 0, as in the reference, which zeroes it before the threshold test."""
    products = tl.dot(row_keys, tl.trans(column_keys), input_precision=DOT_PRECISION)
    similarity = products / (row_norms[:, None] * column_norms[None, :])
    return tl.where(rows[:, None] == columns[None, :], 0.0, similarity)


@triton.jit(do_not_specialize=_TABLE_ARGUMENTS)
def _newest_similar_row_kernel(
    k_cache_ptr,
    source_tables_ptr,
    num_source_blocks_ptr,
    newest_ptr,
    threshold,
    num_requests,
    max_blocks,
    cache_layer_stride,
    cache_block_stride,
    cache_slot_stride,
    cache_head_stride,
    source_table_stride,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    TILE: tl.constexpr,
    LIGHTNING: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (max_blocks * b / TILE, L * R, Hkv): for each column of a tile of columns, the newest (largest) row
    whose similarity exceeds the threshold within the comparison set, or -1."""
    column_tile = tl.program_id(0)
    layer_request = tl.program_id(1)
    kv_head = tl.program_id(2)
    layer = (layer_request // num_requests).to(tl.int64)
    request = layer_request % num_requests
    length = tl.load(num_source_blocks_ptr + request) * BLOCK_SIZE
    column_start = column_tile * TILE
    if column_start < length:
        source_row_ptr = source_tables_ptr + request * source_table_stride
        head_base = layer * cache_layer_stride + kv_head * cache_head_stride
        column_keys, column_norms = _sequence_key_tile(
            k_cache_ptr,
            head_base,
            source_row_ptr,
            column_start,
            cache_block_stride,
            cache_slot_stride,
            BLOCK_SIZE,
            TILE,
            HEAD_DIM,
            HEAD_DIM_PADDED,
        )
        columns = column_start + tl.arange(0, TILE)
        if LIGHTNING:
            first_row = column_start // BLOCK_SIZE * BLOCK_SIZE
            row_start = first_row + BLOCK_SIZE - TILE
        else:
            first_row = 0
            row_start = length - TILE
        newest = tl.full([TILE], -1, tl.int32)
        # Newest rows first: once every column has a row above the threshold, older rows cannot change the answer.
        while (row_start >= first_row) & (tl.min(newest, axis=0) < 0):
            row_keys, row_norms = _sequence_key_tile(
                k_cache_ptr,
                head_base,
                source_row_ptr,
                row_start,
                cache_block_stride,
                cache_slot_stride,
                BLOCK_SIZE,
                TILE,
                HEAD_DIM,
                HEAD_DIM_PADDED,
            )
            rows = row_start + tl.arange(0, TILE)
            similarity = _cosine_similarity(row_keys, row_norms, rows, column_keys, column_norms, columns,
                                            DOT_PRECISION)
            candidates = tl.where(similarity > threshold, rows[:, None], -1)
            newest = tl.maximum(newest, tl.max(candidates, axis=0))
            row_start -= TILE
        sequence_row = (layer_request * NUM_KV_HEADS + kv_head).to(tl.int64) * max_blocks * BLOCK_SIZE
        tl.store(newest_ptr + sequence_row + columns, newest)


@triton.jit(do_not_specialize=_TABLE_ARGUMENTS)
def _redundancy_kernel(
    k_cache_ptr,
    source_tables_ptr,
    num_source_blocks_ptr,
    newest_ptr,
    redundancy_ptr,
    tau,
    num_requests,
    max_blocks,
    cache_layer_stride,
    cache_block_stride,
    cache_slot_stride,
    cache_head_stride,
    source_table_stride,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    TILE: tl.constexpr,
    LIGHTNING: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (max_blocks * b / TILE, L * R, Hkv): for each row of a tile of rows, the sum of its similarities over
    the comparison set without the entries of the columns whose newest above-threshold row it is, divided by
    tau times the size of the comparison set (the redundancy before its softmax)."""
    row_tile = tl.program_id(0)
    layer_request = tl.program_id(1)
    kv_head = tl.program_id(2)
    layer = (layer_request // num_requests).to(tl.int64)
    request = layer_request % num_requests
    length = tl.load(num_source_blocks_ptr + request) * BLOCK_SIZE
    row_start = row_tile * TILE
    if row_start < length:
        source_row_ptr = source_tables_ptr + request * source_table_stride
        head_base = layer * cache_layer_stride + kv_head * cache_head_stride
        row_keys, row_norms = _sequence_key_tile(
            k_cache_ptr,
            head_base,
            source_row_ptr,
            row_start,
            cache_block_stride,
            cache_slot_stride,
            BLOCK_SIZE,
            TILE,
            HEAD_DIM,
            HEAD_DIM_PADDED,
        )
        rows = row_start + tl.arange(0, TILE)
        sequence_row = (layer_request * NUM_KV_HEADS + kv_head).to(tl.int64) * max_blocks * BLOCK_SIZE
        if LIGHTNING:
            first_column = row_start // BLOCK_SIZE * BLOCK_SIZE
            end_column = first_column + BLOCK_SIZE
            compared = BLOCK_SIZE
        else:
            first_column = 0
            end_column = length
            compared = length
        sums = tl.zeros([TILE], tl.float32)
        for column_start in range(first_column, end_column, TILE):
            column_keys, column_norms = _sequence_key_tile(
                k_cache_ptr,
                head_base,
                source_row_ptr,
                column_start,
                cache_block_stride,
                cache_slot_stride,
                BLOCK_SIZE,
                TILE,
                HEAD_DIM,
                HEAD_DIM_PADDED,
            )
            columns = column_start + tl.arange(0, TILE)
            similarity = _cosine_similarity(row_keys, row_norms, rows, column_keys, column_norms, columns,
                                            DOT_PRECISION)
            newest = tl.load(newest_ptr + sequence_row + columns)
            sums += tl.sum(tl.where(rows[:, None] == newest[None, :], 0.0, similarity), axis=1)
        tl.store(redundancy_ptr + sequence_row + rows, sums / (tau * compared))


@triton.jit(do_not_specialize=_BATCH_SHAPE_ARGUMENTS)
def _final_score_kernel(
    scores_ptr,
    redundancy_ptr,
    final_ptr,
    num_source_blocks_ptr,
    is_compressed_ptr,
    lambda_weight,
    num_requests,
    max_blocks,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    WINDOW: tl.constexpr,
    POOLING: tl.constexpr,
    POOL_RADIUS: tl.constexpr,
    REDUNDANCY: tl.constexpr,
    TILE: tl.constexpr,
):
    """Grid (L * R, Hkv): the final score of every entry of one sequence (``[max_blocks * b]``, -inf past the
    request's length, +inf on its window). ``final_ptr`` may be ``redundancy_ptr``: each tile is read before it
    is written, by the same program, and the sequence-wide softmax statistics come from the earlier loops."""
    layer_request = tl.program_id(0)
    kv_head = tl.program_id(1)
    request = layer_request % num_requests
    length = tl.load(num_source_blocks_ptr + request) * BLOCK_SIZE
    sequence_row = (layer_request * NUM_KV_HEADS + kv_head).to(tl.int64) * max_blocks * BLOCK_SIZE
    lanes = tl.arange(0, TILE)
    if REDUNDANCY:
        # Softmax over the sequence of the redundancy, in two sweeps: max, then sum.
        running_max = tl.full([TILE], float("-inf"), tl.float32)
        for start in range(0, length, TILE):
            redundancy = tl.load(redundancy_ptr + sequence_row + start + lanes, mask=start + lanes < length,
                                 other=float("-inf"))
            running_max = tl.maximum(running_max, redundancy)
        redundancy_max = tl.max(running_max, axis=0)
        running_sum = tl.zeros([TILE], tl.float32)
        for start in range(0, length, TILE):
            redundancy = tl.load(redundancy_ptr + sequence_row + start + lanes, mask=start + lanes < length,
                                 other=float("-inf"))
            running_sum += tl.exp(redundancy - redundancy_max)
        redundancy_sum = tl.sum(running_sum, axis=0)
    # Entries that take part in pooling: none for a compressed request under "first".
    pooled_length = length
    if POOLING == 1:
        pooled_length = tl.where(tl.load(is_compressed_ptr + request) == 0, length, 0)
    for start in range(0, max_blocks * BLOCK_SIZE, TILE):
        positions = start + lanes
        inside = positions < length
        score = tl.load(scores_ptr + sequence_row + positions, mask=inside, other=float("-inf"))
        if POOLING != 0:
            # Max-pool with stride 1 and "same" padding: neighbours past either end of the sequence are -inf.
            pooled = score
            for shift in tl.static_range(-POOL_RADIUS, POOL_RADIUS + 1):
                neighbours = positions + shift
                neighbour = tl.load(scores_ptr + sequence_row + neighbours,
                                    mask=(neighbours >= 0) & (neighbours < pooled_length), other=float("-inf"))
                pooled = tl.maximum(pooled, neighbour)
            score = pooled
        if REDUNDANCY:
            redundancy = tl.load(redundancy_ptr + sequence_row + positions, mask=inside, other=0.0)
            softmax = tl.exp(redundancy - redundancy_max) / redundancy_sum
            score = lambda_weight * score - (1 - lambda_weight) * softmax
        score = tl.where(positions >= length - WINDOW, float("inf"), score)
        tl.store(final_ptr + sequence_row + positions, tl.where(inside, score, float("-inf")),
                 mask=positions < max_blocks * BLOCK_SIZE)


@triton.jit
def _needs_staging(source_row_ptr, target_row_ptr, num_blocks, num_targets, TILE: tl.constexpr):
    """Whether some of the request's ``num_targets`` target blocks is also its source block at a later index.
    In-place compaction is safe otherwise (see ``compact_triton``). Tiles of ``TILE`` table entries with runtime
    bounds: padding to the batch's table widths would compile a new variant whenever a new width shows up."""
    hazard = tl.full((), 0, tl.int32)
    for target_start in range(0, num_targets, TILE):
        target_index = target_start + tl.arange(0, TILE)
        targets = tl.load(target_row_ptr + target_index, mask=target_index < num_targets, other=-1)
        for source_start in range(0, num_blocks, TILE):
            source_index = source_start + tl.arange(0, TILE)
            sources = tl.load(source_row_ptr + source_index, mask=source_index < num_blocks, other=-2)
            later = (targets[:, None] == sources[None, :]) & (source_index[None, :] > target_index[:, None])
            hazard = tl.maximum(hazard, tl.max(tl.max(later.to(tl.int32), axis=1), axis=0))
    return hazard > 0


@triton.jit
def _entry_offsets(table_row_ptr, entries, mask, head_base, block_stride, slot_stride, BLOCK_SIZE: tl.constexpr):
    """Offsets of sequence entries ``entries`` of the sequence whose block table row is ``table_row_ptr``."""
    block_ids = tl.load(table_row_ptr + entries // BLOCK_SIZE, mask=mask, other=0).to(tl.int64)
    return head_base + block_ids * block_stride + (entries % BLOCK_SIZE) * slot_stride


@triton.jit(do_not_specialize=[*_TABLE_ARGUMENTS, "target_table_stride", "keep_width"])
def _compact_in_place_kernel(
    k_cache_ptr,
    v_cache_ptr,
    score_cache_ptr,
    scores_ptr,
    kept_ptr,
    source_tables_ptr,
    num_source_blocks_ptr,
    target_tables_ptr,
    num_target_blocks_ptr,
    staging_queue_ptr,
    staging_count_ptr,
    num_requests,
    max_blocks,
    keep_width,
    cache_layer_stride,
    cache_block_stride,
    cache_slot_stride,
    cache_head_stride,
    score_layer_stride,
    score_block_stride,
    score_slot_stride,
    score_head_stride,
    source_table_stride,
    target_table_stride,
    k_scale_ptr,
    v_scale_ptr,
    scale_layer_stride,
    scale_block_stride,
    scale_slot_stride,
    NUM_KV_HEADS: tl.constexpr,
    NUM_DIM_TILES: tl.constexpr,
    TABLE_TILE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_TILE: tl.constexpr,
    ENTRY_TILE: tl.constexpr,
    GLOBAL_SCORE: tl.constexpr,
    FP8: tl.constexpr,
):
    """Grid (L * R, Hkv, head-dim tiles): the two-pointer move of one (layer, request, KV head)'s kept K and V
    entries (one slice of the head dim) into the target blocks, chunk by chunk in order; the slice-0 program also
    moves the kept global scores and, for an FP8 cache, the kept K and V scales (in the same chunks as the values,
    so the in-place argument covers them). A request whose targets make in-place unsafe is queued for the staged
    kernel.
    ``keep_width`` is the widest request's count; request r moves its first ``num_target_blocks[r] * BLOCK_SIZE``."""
    layer_request = tl.program_id(0)
    kv_head = tl.program_id(1)
    dim_tile = tl.program_id(2)
    layer = (layer_request // num_requests).to(tl.int64)
    request = layer_request % num_requests
    num_blocks = tl.load(num_source_blocks_ptr + request)
    num_targets = tl.load(num_target_blocks_ptr + request)
    keep = num_targets * BLOCK_SIZE
    source_row_ptr = source_tables_ptr + request * source_table_stride
    target_row_ptr = target_tables_ptr + request * target_table_stride
    item = (layer_request * NUM_KV_HEADS + kv_head).to(tl.int64)
    kept_row_ptr = kept_ptr + item * keep_width
    head_base = layer * cache_layer_stride + kv_head * cache_head_stride
    dims = dim_tile * DIM_TILE + tl.arange(0, DIM_TILE)
    lanes = tl.arange(0, ENTRY_TILE)
    if _needs_staging(source_row_ptr, target_row_ptr, num_blocks, num_targets, TABLE_TILE):
        queue_index = tl.atomic_add(staging_count_ptr, 1)
        tl.store(staging_queue_ptr + queue_index, item * NUM_DIM_TILES + dim_tile)
    else:
        for entry_start in range(0, keep_width, ENTRY_TILE):
            entries = entry_start + lanes
            used = entries < keep
            kept = tl.load(kept_row_ptr + entries, mask=used, other=0)
            source = _entry_offsets(source_row_ptr, kept, used, head_base, cache_block_stride, cache_slot_stride,
                                    BLOCK_SIZE)
            mask = used[:, None] & (dims < HEAD_DIM)[None, :]
            keys = tl.load(k_cache_ptr + source[:, None] + dims[None, :], mask=mask)
            values = tl.load(v_cache_ptr + source[:, None] + dims[None, :], mask=mask)
            if FP8:
                # The slice-0 program moves the entries' scales along with its slice of their bytes.
                scale_head_base = layer * scale_layer_stride + kv_head
                scale_used = used & ((lanes * 0 + dim_tile) == 0)  # a vector mask (the interpreter wants one)
                scale_source = _entry_offsets(source_row_ptr, kept, scale_used, scale_head_base, scale_block_stride,
                                              scale_slot_stride, BLOCK_SIZE)
                key_scales = tl.load(k_scale_ptr + scale_source, mask=scale_used)
                value_scales = tl.load(v_scale_ptr + scale_source, mask=scale_used)
            # Slots this chunk reads may be the very slots it writes (a target block that is also a source
            # block), by other threads of this program: every load of the chunk lands before any store.
            tl.debug_barrier()
            target = _entry_offsets(target_row_ptr, entries, used, head_base, cache_block_stride, cache_slot_stride,
                                    BLOCK_SIZE)
            tl.store(k_cache_ptr + target[:, None] + dims[None, :], keys, mask=mask)
            tl.store(v_cache_ptr + target[:, None] + dims[None, :], values, mask=mask)
            if FP8:
                scale_target = _entry_offsets(target_row_ptr, entries, scale_used, scale_head_base,
                                              scale_block_stride, scale_slot_stride, BLOCK_SIZE)
                tl.store(k_scale_ptr + scale_target, key_scales, mask=scale_used)
                tl.store(v_scale_ptr + scale_target, value_scales, mask=scale_used)
    if GLOBAL_SCORE:
        if dim_tile == 0:
            # The kept scores come from the dense scores of this call, never from the cache: no hazard here.
            score_head_base = layer * score_layer_stride + kv_head * score_head_stride
            scores_row = item * max_blocks * BLOCK_SIZE
            for entry_start in range(0, keep_width, ENTRY_TILE):
                entries = entry_start + lanes
                used = entries < keep
                kept = tl.load(kept_row_ptr + entries, mask=used, other=0)
                kept_scores = tl.load(scores_ptr + scores_row + kept, mask=used)
                target = _entry_offsets(target_row_ptr, entries, used, score_head_base, score_block_stride,
                                        score_slot_stride, BLOCK_SIZE)
                tl.store(score_cache_ptr + target, kept_scores.to(score_cache_ptr.dtype.element_ty), mask=used)


@triton.jit(do_not_specialize=["num_requests", "keep_width", "source_table_stride", "target_table_stride"])
def _compact_staged_kernel(
    k_cache_ptr,
    v_cache_ptr,
    k_scratch_ptr,
    v_scratch_ptr,
    kept_ptr,
    source_tables_ptr,
    target_tables_ptr,
    num_target_blocks_ptr,
    staging_queue_ptr,
    staging_count_ptr,
    num_requests,
    keep_width,
    cache_layer_stride,
    cache_block_stride,
    cache_slot_stride,
    cache_head_stride,
    source_table_stride,
    target_table_stride,
    k_scale_ptr,
    v_scale_ptr,
    k_scale_scratch_ptr,
    v_scale_scratch_ptr,
    scale_layer_stride,
    scale_block_stride,
    scale_slot_stride,
    NUM_KV_HEADS: tl.constexpr,
    NUM_DIM_TILES: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_TILE: tl.constexpr,
    ENTRY_TILE: tl.constexpr,
    FP8: tl.constexpr,
):
    """Grid (programs,): each program takes queued items in turn and moves their kept K and V entries through its
    private scratch ``[keep_width, DIM_TILE]``: all gathered first, then all written. Costs one launch and one load when
    the queue is empty (the common case)."""
    program = tl.program_id(0)
    num_staged = tl.load(staging_count_ptr)
    lanes = tl.arange(0, ENTRY_TILE)
    scratch_dims = tl.arange(0, DIM_TILE)
    scratch_base = program.to(tl.int64) * keep_width * DIM_TILE
    for queue_index in range(program, num_staged, tl.num_programs(0)):
        staged = tl.load(staging_queue_ptr + queue_index)
        item = staged // NUM_DIM_TILES
        dims = (staged % NUM_DIM_TILES) * DIM_TILE + scratch_dims
        layer_request = item // NUM_KV_HEADS
        kv_head = item % NUM_KV_HEADS
        layer = layer_request // num_requests
        request = layer_request % num_requests
        source_row_ptr = source_tables_ptr + request * source_table_stride
        target_row_ptr = target_tables_ptr + request * target_table_stride
        kept_row_ptr = kept_ptr + item * keep_width
        keep = tl.load(num_target_blocks_ptr + request) * BLOCK_SIZE
        head_base = layer * cache_layer_stride + kv_head * cache_head_stride
        scale_head_base = layer * scale_layer_stride + kv_head
        # FP8: the slice-0 item moves the scales too (a vector mask: the interpreter wants one).
        moves_scales = (lanes * 0 + staged % NUM_DIM_TILES) == 0
        for entry_start in range(0, keep_width, ENTRY_TILE):
            entries = entry_start + lanes
            used = entries < keep
            kept = tl.load(kept_row_ptr + entries, mask=used, other=0)
            source = _entry_offsets(source_row_ptr, kept, used, head_base, cache_block_stride, cache_slot_stride,
                                    BLOCK_SIZE)
            mask = used[:, None] & (dims < HEAD_DIM)[None, :]
            scratch = scratch_base + entries[:, None] * DIM_TILE + scratch_dims[None, :]
            tl.store(k_scratch_ptr + scratch, tl.load(k_cache_ptr + source[:, None] + dims[None, :], mask=mask),
                     mask=mask)
            tl.store(v_scratch_ptr + scratch, tl.load(v_cache_ptr + source[:, None] + dims[None, :], mask=mask),
                     mask=mask)
            if FP8:
                scale_used = used & moves_scales
                scale_source = _entry_offsets(source_row_ptr, kept, scale_used, scale_head_base, scale_block_stride,
                                              scale_slot_stride, BLOCK_SIZE)
                scale_scratch = program.to(tl.int64) * keep_width + entries
                tl.store(k_scale_scratch_ptr + scale_scratch, tl.load(k_scale_ptr + scale_source, mask=scale_used),
                         mask=scale_used)
                tl.store(v_scale_scratch_ptr + scale_scratch, tl.load(v_scale_ptr + scale_source, mask=scale_used),
                         mask=scale_used)
        # Every kept entry is in the scratch before any target slot (possibly a slot just read) is written.
        tl.debug_barrier()
        for entry_start in range(0, keep_width, ENTRY_TILE):
            entries = entry_start + lanes
            used = entries < keep
            mask = used[:, None] & (dims < HEAD_DIM)[None, :]
            scratch = scratch_base + entries[:, None] * DIM_TILE + scratch_dims[None, :]
            target = _entry_offsets(target_row_ptr, entries, used, head_base, cache_block_stride, cache_slot_stride,
                                    BLOCK_SIZE)
            tl.store(k_cache_ptr + target[:, None] + dims[None, :], tl.load(k_scratch_ptr + scratch, mask=mask),
                     mask=mask)
            tl.store(v_cache_ptr + target[:, None] + dims[None, :], tl.load(v_scratch_ptr + scratch, mask=mask),
                     mask=mask)
            if FP8:
                scale_used = used & moves_scales
                scale_target = _entry_offsets(target_row_ptr, entries, scale_used, scale_head_base,
                                              scale_block_stride, scale_slot_stride, BLOCK_SIZE)
                scale_scratch = program.to(tl.int64) * keep_width + entries
                tl.store(k_scale_ptr + scale_target, tl.load(k_scale_scratch_ptr + scale_scratch, mask=scale_used),
                         mask=scale_used)
                tl.store(v_scale_ptr + scale_target, tl.load(v_scale_scratch_ptr + scale_scratch, mask=scale_used),
                         mask=scale_used)
        # The next item's gathers overwrite the scratch this item's writes are still reading.
        tl.debug_barrier()


def _check_inputs(k_cache: torch.Tensor, v_cache: torch.Tensor, score_cache: torch.Tensor | None,
                  query_cache: torch.Tensor, params: CompressionParams) -> None:
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or query_cache.stride(-1) != 1:
        raise ValueError(
            "k_cache and v_cache must share one layout [layers, num_blocks, block_size, num_kv_heads, head_dim] "
            f"with a contiguous head_dim (got strides {tuple(k_cache.stride())} and {tuple(v_cache.stride())}), "
            "and query_cache needs a contiguous head_dim")
    if query_cache.dtype != k_cache.dtype and k_cache.dtype != torch.float8_e4m3fn:
        raise ValueError(f"query_cache is {query_cache.dtype} but the KV cache is {k_cache.dtype}; they must match")
    if k_cache.shape[2] != params.block_size or query_cache.shape[2] != params.window:
        raise ValueError(
            f"caches of block size {k_cache.shape[2]} and window {query_cache.shape[2]} do not match the "
            f"parameters (block_size={params.block_size}, window={params.window})")
    if query_cache.shape[3] % k_cache.shape[3] != 0:
        raise ValueError(f"query heads ({query_cache.shape[3]}) must be a multiple of KV heads ({k_cache.shape[3]})")
    if params.global_score and score_cache is None:
        raise ValueError("the global score is on but score_cache is None")
    if params.pooling not in _POOLING_MODES or params.redundancy not in _REDUNDANCY_MODES:
        raise ValueError(f"unknown pooling {params.pooling!r} or redundancy {params.redundancy!r}")
    if params.pool_kernel % 2 != 1:
        raise ValueError(f"pool_kernel must be odd (a 'same'-length max-pool), got {params.pool_kernel}")


def attention_scores_triton(k_cache: torch.Tensor, score_cache: torch.Tensor | None, query_cache: torch.Tensor,
                            source_tables: torch.Tensor, num_source_blocks: torch.Tensor,
                            query_slots: torch.Tensor, is_compressed: torch.Tensor, params: CompressionParams,
                            scale: float, k_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Steps 1-2: S ``[L, R, Hkv, max_blocks * b]`` float32, the attention score merged with the global score when
    it is on (the values the compaction stores into the score cache). Entries past a request's length are unset.
    An FP8 cache's keys are read with their scales ``k_scale`` ``[L, num_blocks, b, Hkv]``."""
    layers, _, block_size, kv_heads, head_dim = k_cache.shape
    requests, max_blocks = source_tables.shape
    window, query_heads = query_cache.shape[2], query_cache.shape[3]
    group = query_heads // kv_heads
    group_padded = triton.next_power_of_2(group)
    # Rows of the query matrix: at least 16, the smallest tl.dot.
    window_padded = max(triton.next_power_of_2(window), _MIN_DOT_DIM // group_padded)
    rows = window_padded * group_padded
    key_tile = min(_SCORE_KEY_TILE, block_size)
    statistics = torch.empty((layers * requests * kv_heads * max_blocks, rows), dtype=torch.float32,
                             device=k_cache.device)
    block_sums = torch.empty_like(statistics)
    scores = torch.empty((layers, requests, kv_heads, max_blocks * block_size), dtype=torch.float32,
                         device=k_cache.device)
    grid = (max_blocks, layers * requests, kv_heads)
    shapes = dict(NUM_KV_HEADS=kv_heads, WINDOW=window, GROUP=group, WINDOW_PADDED=window_padded,
                  GROUP_PADDED=group_padded, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
                  HEAD_DIM_PADDED=_padded_dim(head_dim), KEY_TILE=key_tile,
                  DOT_PRECISION=_dot_precision(query_cache.dtype), FP8=k_scale is not None,
                  num_warps=4 if rows * key_tile <= 8192 else 8)
    scale_arguments = ((k_scale, *k_scale.stride()[:3]) if k_scale is not None else (scores, 0, 0, 0))
    query_strides = query_cache.stride()[:4]
    cache_strides = k_cache.stride()[:4]
    qk_scale = scale * _LOG2_E
    _block_softmax_stats_kernel[grid](
        query_cache, k_cache, source_tables, num_source_blocks, query_slots, statistics, block_sums, qk_scale,
        requests, max_blocks, *query_strides, *cache_strides, source_tables.stride(0), *scale_arguments, **shapes)
    global_score = params.global_score
    # Without a global score the kernel never touches the score cache; any tensor fills the pointer argument.
    score_tensor = score_cache if global_score else scores
    score_strides = score_cache.stride() if global_score else (0, 0, 0, 0)
    _attention_score_kernel[grid](
        query_cache, k_cache, score_tensor, source_tables, num_source_blocks, query_slots, is_compressed,
        statistics, block_sums, scores, qk_scale, params.alpha, requests, max_blocks, *query_strides,
        *cache_strides, *score_strides, source_tables.stride(0), *scale_arguments, STATS_CHUNK=_STATS_CHUNK,
        GLOBAL_SCORE=global_score, **shapes)
    return scores


def redundancy_triton(k_cache: torch.Tensor, source_tables: torch.Tensor, num_source_blocks: torch.Tensor,
                      params: CompressionParams) -> torch.Tensor:
    """Step 4 before its softmax: ``[L, R, Hkv, max_blocks * b]`` float32 row sums over tau times the comparison
    set's size ("lightning" or "flash"). Entries past a request's length are unset."""
    layers, _, block_size, kv_heads, head_dim = k_cache.shape
    requests, max_blocks = source_tables.shape
    tile = min(_REDUNDANCY_TILE, block_size)
    newest = torch.empty((layers, requests, kv_heads, max_blocks * block_size), dtype=torch.int32,
                         device=k_cache.device)
    redundancy = torch.empty(newest.shape, dtype=torch.float32, device=k_cache.device)
    grid = (max_blocks * block_size // tile, layers * requests, kv_heads)
    common = (requests, max_blocks, *k_cache.stride()[:4], source_tables.stride(0))
    shapes = dict(NUM_KV_HEADS=kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
                  HEAD_DIM_PADDED=_padded_dim(head_dim), TILE=tile, LIGHTNING=params.redundancy == "lightning",
                  DOT_PRECISION=_dot_precision(k_cache.dtype))
    _newest_similar_row_kernel[grid](k_cache, source_tables, num_source_blocks, newest,
                                     params.similarity_threshold, *common, **shapes)
    _redundancy_kernel[grid](k_cache, source_tables, num_source_blocks, newest, redundancy, params.tau, *common,
                             **shapes)
    return redundancy


def final_scores_triton(scores: torch.Tensor, redundancy: torch.Tensor | None, num_source_blocks: torch.Tensor,
                        is_compressed: torch.Tensor, params: CompressionParams) -> torch.Tensor:
    """Steps 3-5: ``[L, R, Hkv, max_blocks * b]`` float32 final scores, -inf past each request's length. Written
    over ``redundancy`` when there is one (it is not needed afterwards)."""
    layers, requests, kv_heads, _ = scores.shape
    final = redundancy if redundancy is not None else torch.empty_like(scores)
    _final_score_kernel[(layers * requests, kv_heads)](
        scores, final, final, num_source_blocks, is_compressed, params.lambda_weight, requests,
        scores.shape[3] // params.block_size, NUM_KV_HEADS=kv_heads, BLOCK_SIZE=params.block_size,
        WINDOW=params.window, POOLING=_POOLING_MODES[params.pooling], POOL_RADIUS=params.pool_kernel // 2,
        REDUNDANCY=redundancy is not None, TILE=_FINAL_TILE)
    return final


def compression_scores_triton(k_cache: torch.Tensor, score_cache: torch.Tensor | None, query_cache: torch.Tensor,
                              source_tables: torch.Tensor, num_source_blocks: torch.Tensor,
                              query_slots: torch.Tensor, is_compressed: torch.Tensor, params: CompressionParams,
                              scale: float, k_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(final scores, S): steps 1-5 for the whole batch, each ``[L, R, Hkv, max_blocks * b]`` float32."""
    scores = attention_scores_triton(k_cache, score_cache, query_cache, source_tables, num_source_blocks,
                                     query_slots, is_compressed, params, scale, k_scale)
    redundancy = (redundancy_triton(k_cache, source_tables, num_source_blocks, params)
                  if params.redundancy != "off" else None)
    return final_scores_triton(scores, redundancy, num_source_blocks, is_compressed, params), scores


def compact_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, score_cache: torch.Tensor | None,
                   source_tables: torch.Tensor, num_source_blocks: torch.Tensor, target_tables: torch.Tensor,
                   kept: torch.Tensor, scores: torch.Tensor, global_score: bool,
                   num_target_blocks: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """Step 7: write the kept entries ``kept`` (int64 ``[L, R, Hkv, keep]``, sorted) densely into the target blocks:
    K and V from the source blocks, global scores (when on) from ``scores``. Request r fills its first
    ``num_target_blocks[r]`` target blocks with its first ``num_target_blocks[r] * b`` kept entries (None: every
    request fills all of them, ``keep`` = their count times b).

    In place, chunk by chunk in order, when no target block is a source block of the same request at a *later*
    index (true of the core's targets, which are fresh blocks or the request's own blocks at the same index): the
    c-th chunk reads kept entries at source positions >= its own positions (kept entries are in order), while the
    earlier chunks wrote target positions p whose slots are source positions <= p, so no chunk reads a slot an
    earlier chunk wrote; within a chunk a barrier puts every load before every store. A request with such a later
    target (a shared block in the middle of its table makes its own blocks move up) is queued, per (layer, KV
    head, head-dim slice), to the staged kernel, which gathers all its kept entries into a scratch first.
    Requests never share a target (targets are fresh or the request's own unshared blocks).

    An FP8 cache (with ``k_scale``/``v_scale`` ``[L, num_blocks, b, Hkv]``) is moved as bytes, and each kept
    entry's scales move with it: nothing is requantized.
    """
    fp8 = k_scale is not None
    if fp8:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    layers, _, block_size, kv_heads, head_dim = k_cache.shape
    requests, max_blocks = source_tables.shape
    num_targets = target_tables.shape[1]
    if num_target_blocks is None:
        num_target_blocks = torch.full((requests,), num_targets, dtype=torch.int32, device=k_cache.device)
    kept = kept.contiguous()  # the kernels step through it row by row
    keep = kept.shape[-1]
    dim_tile = min(_COMPACTION_DIM_TILE, triton.next_power_of_2(head_dim))
    num_dim_tiles = triton.cdiv(head_dim, dim_tile)
    device = k_cache.device
    staging_count = torch.zeros(1, dtype=torch.int32, device=device)
    staging_queue = torch.empty(layers * requests * kv_heads * num_dim_tiles, dtype=torch.int64, device=device)
    cache_strides = k_cache.stride()[:4]
    score_tensor = score_cache if global_score else scores
    score_strides = score_cache.stride() if global_score else (0, 0, 0, 0)
    # No software pipelining: a load issued asynchronously ahead of its use could complete after the barrier
    # that must order it before the chunk's stores.
    shapes = dict(NUM_KV_HEADS=kv_heads, NUM_DIM_TILES=num_dim_tiles, BLOCK_SIZE=block_size,
                  HEAD_DIM=head_dim, DIM_TILE=dim_tile, ENTRY_TILE=_COMPACTION_ENTRIES, FP8=fp8, num_stages=1)
    # Without FP8 the scale arguments are never read; any tensor fills the pointers.
    scale_tensors = (k_scale, v_scale) if fp8 else (staging_count, staging_count)
    scale_strides = k_scale.stride()[:3] if fp8 else (0, 0, 0)
    scale_arguments = (*scale_tensors, *scale_strides)
    _compact_in_place_kernel[(layers * requests, kv_heads, num_dim_tiles)](
        k_cache, v_cache, score_tensor, scores, kept, source_tables, num_source_blocks, target_tables,
        num_target_blocks, staging_queue, staging_count, requests, max_blocks, keep, *cache_strides, *score_strides,
        source_tables.stride(0), target_tables.stride(0), *scale_arguments,
        TABLE_TILE=_COMPACTION_TABLE_TILE, GLOBAL_SCORE=global_score, **shapes)
    programs = _STAGING_PROGRAMS if device.type == "cuda" else _INTERPRETER_STAGING_PROGRAMS
    k_scratch = torch.empty((programs, keep, dim_tile), dtype=k_cache.dtype, device=device)
    v_scratch = torch.empty_like(k_scratch)
    scale_scratch = (torch.empty((2, programs, keep), dtype=torch.float32, device=device) if fp8
                     else staging_count.expand(2, 1))
    _compact_staged_kernel[(programs,)](
        k_cache, v_cache, k_scratch, v_scratch, kept, source_tables, target_tables, num_target_blocks, staging_queue,
        staging_count, requests, keep, *cache_strides, source_tables.stride(0), target_tables.stride(0),
        *scale_tensors, scale_scratch[0], scale_scratch[1], *scale_strides, **shapes)


def compress_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, score_cache: torch.Tensor | None,
                    query_cache: torch.Tensor, source_tables: torch.Tensor, num_source_blocks: torch.Tensor,
                    target_tables: torch.Tensor, query_slots: torch.Tensor, is_compressed: torch.Tensor,
                    params: CompressionParams, scale: float, *,
                    num_target_blocks: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, seeds: torch.Tensor | None = None) -> None:
    """Compress a batch of requests over a group of layers; arguments and semantics of ``compress_ref`` (an FP8
    cache comes with its scales: the scores read the keys with theirs, the compaction moves both). `seeds`:
    the requests' seeds, which every fast path takes (the pipeline draws nothing; the random policy's uses them)."""
    _check_inputs(k_cache, v_cache, score_cache, query_cache, params)
    if (k_cache.dtype == torch.float8_e4m3fn) != (k_scale is not None) or (k_scale is None) != (v_scale is None):
        needed = "both" if k_cache.dtype == torch.float8_e4m3fn else "no"
        raise ValueError(f"a {k_cache.dtype} KV cache takes {needed} k_scale and v_scale")
    final, scores = compression_scores_triton(k_cache, score_cache, query_cache, source_tables, num_source_blocks,
                                              query_slots, is_compressed, params, scale, k_scale)
    kept = batch_kept_entries(final, target_tables.shape[1] * params.block_size, params.block_size,
                              num_target_blocks)
    compact_triton(k_cache, v_cache, score_cache, source_tables, num_source_blocks, target_tables, kept, scores,
                   params.global_score, num_target_blocks, k_scale, v_scale)
