"""Paged attention: attend through each sequence's block table to the K/V in the cache's slots.

The KV cache of one layer is two tensors [num_blocks, block_size, num_kv_heads, head_dim]; a sequence's tokens live in
the blocks its block table lists, in order, so physical blocks need not be contiguous (PagedAttention, Kwon et al.
2023). This step's K/V reach their slots first: stored by the layer's rotation (layer_ops.py, whose reference calls
`store_kv_ref` here; with the fused kernels, the Triton program that rotates K stores it). Then two Triton jobs: a
flash-attention kernel (FlashAttention-2, Dao 2023: query tiles, online softmax) serves the sequences with several
queries (prefill chunks), causal and varlen; a split-KV kernel (Flash-Decoding, Dao et al. 2023) serves the sequences
with one query (decodes), also inside a mixed step, by splitting each sequence's keys across programs, then merging
their partial softmaxes in a small reduce kernel (a batch that fills the GPU by itself gets one split, which writes the
output: no reduce). Each kernel skips the other's sequences, so a mixed step is one prefill launch and the decode's one
or two over one metadata. These are the textbook kernels, as the last GPU run measured them (2026-11-27); the batch-1
latency tricks that remove launches (the reduce merged into the last split to finish, programmatic dependent launch) are
the extension ext/latency, off by default until a GPU run measures them. Every key is read from the cache, so the store
runs before attention. The PyTorch references at the bottom are the oracle the kernels are tested against, and the CPU's
fast path. Words: a "block" is a KV-cache page, a "tile" a kernel's compute tile.

FP8 KV cache (kv_cache_dtype="fp8"): the caches are float8 e4m3 (1 byte per element, half of bf16's), written by a
saturating round-to-nearest cast (on a GPU and in torch; Triton's CPU interpreter rounds roughly, so its tests feed
it fp8-exact values), i.e. a scale of 1.0 for K and V in every layer, vLLM's default when a checkpoint brings no
calibrated scales. e4m3 is a float: 3 mantissa bits at every magnitude from 2^-6 to 448, so a scale would
only move that range, and K/V activations sit inside it (tests/test_fp8_kv.py measures them). The kernels widen each
fp8 tile to the query's dtype (exact: every e4m3 value is a bf16, fp16 and fp32 value) and accumulate in fp32; the
references widen to fp32. Neither kernel nor reference branches on the cache's dtype."""

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from nanoserve.triton_shim import tl, triton

PAD_SLOT = -1  # slot_mapping value of a padded token: the KV store skips it
LOG2E = 1.4426950408889634  # log2(e) = 1/ln(2): softmax runs on exp2, so the score scale absorbs it
MIN_DOT_ROWS = 16  # tl.dot needs >= 16 rows: small query tiles and decode GQA groups are padded up to this
# Tiles by element size in bytes (bf16 and fp16: 2, fp32: 4, fp8: 1): the largest that build for sm_90 without spilling
# registers (tests/sm90_build.py). 16-bit dots run on the tensor cores; fp32 ones (IEEE, not tf32) on the FMA units,
# whose operand tiles sit in registers, and fp8 K/V tiles are widened in registers: both need smaller tiles.
PREFILL_TILE_M = {2: 128, 4: 32}  # most query rows per prefill program, by the query's element size (16-bit: the
# Triton fused-attention tutorial's H100 choice)
# keys per step of the prefill loop: 64, as the H100 measured it (2026-11-27); 128 for the wide tile is a prediction
# (BENCHMARKS.md) that gpu_check.sh's sweep times beside it
PREFILL_TILE_N = 64
PREFILL_WIDE_TILE_M = {2: 128, 4: 16}  # prefill tiles of this many rows or more run on 8 warps (16-bit: 2 warpgroups)
PREFILL_NUM_STAGES = 3  # K/V tiles in flight in the prefill loop's software pipeline (Triton's default, named for
# bench_kernels.py's sweep)
# keys per step of a decode split, by the query's and the cache's element sizes
DECODE_TILE_N = {
    (2, 2): 64,
    (2, 1): 32,
    (4, 4): 16,
    (4, 1): 16,
}
DECODE_NUM_WARPS = 4
PROGRAMS_PER_SM = 4  # decode splits the keys until the grid has about this many programs per SM
REFERENCE_RUN_SIZE = 1 << 24  # the PyTorch reference's padded queries x keys per SDPA call (reference_groups)
MAX_SPLITS = 64  # the reduce kernel holds all partials of a head, [MAX_SPLITS, head_dim] fp32, in registers
CPU_NUM_SMS = 4  # SM count assumed under TRITON_INTERPRET: small, yet CPU tests still see several splits
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)  # powers of two; 256 would overflow the registers of a 128-row tile


@dataclass
class AttentionMetadata:
    """One step's batch as attention sees it: built once per step by the runner, checked here, passed to every layer."""

    slot_mapping: Tensor  # [num_tokens] int32: block_id * block_size + offset, or PAD_SLOT
    query_start_loc: Tensor  # [num_seqs + 1] int32: sequence i's queries are rows [qsl[i], qsl[i+1])
    context_lens: Tensor  # [num_seqs] int32: keys per sequence after this step (cached + new)
    block_tables: Tensor  # [num_seqs, max_blocks_per_seq] int32
    max_query_len: int  # a host-side bound, so launching a kernel never reads the GPU
    decode_only: bool  # every sequence has exactly one query token
    # what the PyTorch reference derives from the above (gather_for_reference, per run of sequences): the same for
    # every layer, so paged_attention_ref computes it in the step's first layer and the others reuse it; no caller
    # passes it
    reference_gather: list[tuple] | None = None

    def __post_init__(self) -> None:
        num_seqs = len(self.context_lens)
        for t in (self.slot_mapping, self.query_start_loc, self.context_lens, self.block_tables):
            assert t.dtype == torch.int32 and t.device == self.context_lens.device, "metadata: int32, one device"
        assert self.query_start_loc.shape == (num_seqs + 1,) and len(self.block_tables) == num_seqs
        assert self.block_tables.stride(1) == 1
        assert not self.decode_only or len(self.slot_mapping) == num_seqs, "decode: one query per sequence"


@triton.jit
def attend_key_tiles(
    q,
    last_key,
    start,
    unmasked_end,
    end,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    head_offset,
    stride_cb,
    stride_cs,
    qk_scale,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
):
    """Attend q's rows to the keys of one sequence at positions [start, end), TILE_N at a time (flash attention: an
    online softmax per row); returns its state (row_max, row_sum, acc), below. q: [M, HEAD_DIM]. K/V tiles come in
    the cache's dtype and are widened to q's (exact for fp8). Each key position looks up its own block in the
    sequence's block table, so a tile may span several small blocks or part of a big one; head_offset (kv_head *
    stride_ch) is where the KV head's elements start within a slot.
    Two passes of one loop body, each compiled on its own (MASKED is a compile-time constant):
      unmasked, tiles [start, unmasked_end): whole tiles known to lie below end and below every row's last key, so
        no load is predicated and every key is seen (unmasked_end == start: none);
      masked, [unmasked_end, end): row i sees the keys at positions <= last_key[i] (last_key: [M, 1], or one scalar
        for every row), and positions >= end load 0, since their slots may hold garbage and 0 * garbage can be NaN.
    Every row must see a key by its first tile, or its max stays -inf and the rescale is NaN."""
    # the online softmax's running state per row: max score, sum of exp2(score - max), unnormalised output (fp32)
    row_max = tl.full([q.shape[0]], float("-inf"), tl.float32)  # [M]
    row_sum = tl.zeros_like(row_max)  # [M]
    acc = tl.zeros(q.shape, tl.float32)  # [M, HEAD_DIM]
    for MASKED in tl.static_range(2):  # unrolled: the unmasked pass (MASKED = 0), then the masked one (1)
        lo = start
        hi = unmasked_end
        if MASKED:
            lo = unmasked_end
            hi = end
        for n in range(lo, hi, TILE_N):
            pos = n + tl.arange(0, TILE_N)  # [TILE_N] key positions
            # [TILE_N, HEAD_DIM] offsets of the keys within their blocks; the blocks' own offsets are added next
            offs = tl.arange(0, q.shape[1])[None, :] + head_offset + (pos % BLOCK_SIZE)[:, None] * stride_cs
            if MASKED:
                valid = pos < end
                block = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
                offs += block[:, None] * stride_cb
                k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0)
                v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0)
                visible = pos[None, :] <= last_key  # [M, TILE_N] or [1, TILE_N]
            else:
                offs += tl.load(block_table_ptr + pos // BLOCK_SIZE).to(tl.int64)[:, None] * stride_cb
                k = tl.load(k_cache_ptr + offs)
                v = tl.load(v_cache_ptr + offs)
            # [M, TILE_N] scores in log2 units; fp32 dots in IEEE fp32, not tf32
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee") * qk_scale
            if MASKED:
                s = tl.where(visible, s, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(s, 1))
            alpha = tl.exp2(row_max - new_max)  # rescales what was summed under the old max
            p = tl.exp2(s - new_max[:, None])  # [M, N] this tile's weights under the new max
            row_sum = row_sum * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
            row_max = new_max
    return row_max, row_sum, acc


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    out_ptr,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_M: tl.constexpr,
    TILE_N: tl.constexpr,
):
    # program (tile, seq, head): queries [tile * TILE_M, (tile + 1) * TILE_M) of sequence seq, query head head
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile * TILE_M >= q_len or q_len == 1:  # shorter than the grid's longest query, or a decode: the decode kernel's
        return
    ctx = tl.load(context_lens_ptr + seq)
    rows = tile * TILE_M + tl.arange(0, TILE_M)  # [TILE_M] query index within the sequence
    q_pos = ctx - q_len + rows  # the queries are the sequence's last tokens
    real_rows = (rows < q_len)[:, None]  # [TILE_M, 1]: rows past the sequence's last query are padding
    d = tl.arange(0, HEAD_DIM)[None, :]  # [1, HEAD_DIM]
    tokens = (q_start + rows)[:, None]  # [TILE_M, 1] the queries' rows of q and out
    q_at = q_ptr + tokens * stride_qt + head * stride_qh + d
    q = tl.load(q_at, mask=real_rows, other=0.0)  # [TILE_M, HEAD_DIM]
    # Keys up to the tile's first query are seen by all its rows: whole tiles of them need no mask. Keys after
    # its last query are seen by none: stop there (skips the tiles above the diagonal).
    first_q_pos = ctx - q_len + tile * TILE_M  # the position of the tile's first query
    unmasked_end = (first_q_pos + 1) // TILE_N * TILE_N  # whole key tiles at positions <= first_q_pos
    kv_end = tl.minimum(ctx, first_q_pos + TILE_M)  # one past the tile's last query
    # then the diagonal, masked: the causal mask (a query sees the keys up to its own position) also hides keys
    # >= kv_end from real queries
    _, row_sum, acc = attend_key_tiles(
        q,
        q_pos[:, None],
        0,
        unmasked_end,
        kv_end,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr + seq * stride_bt,
        head // GROUP * stride_ch,  # the KV head's offset within a slot
        stride_cb,
        stride_cs,
        qk_scale,
        BLOCK_SIZE,
        TILE_N,
    )
    tl.store(
        out_ptr + tokens * stride_ot + head * stride_oh + d,
        (acc / row_sum[:, None]).to(out_ptr.dtype.element_ty),
        mask=real_rows,
    )


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    out_ptr,
    stride_ot,
    stride_oh,
    part_out_ptr,
    part_lse_ptr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
):
    # program (seq, kv_head, split): the GROUP query heads sharing kv_head (rows of one tl.dot, so each K/V byte
    # is read once) attend to the split-th of num_splits equal runs of whole key tiles of sequence seq's context,
    # if seq has one query (a decode); its split length follows its own context, so a CUDA graph's fixed grid
    # keeps every split busy whatever the context. Each split writes its partial output and log-sum-exp for the
    # reduce kernel; with ONE_SPLIT (a batch that fills the GPU by itself) the one split's output is the answer and
    # goes straight to out (the part pointers are not used, and no reduce runs).
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) - q_row != 1:  # several queries: the prefill kernel's
        return
    ctx = tl.load(context_lens_ptr + seq)
    split_len = tl.cdiv(ctx, tl.num_programs(2) * TILE_N) * TILE_N
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)  # <= start: the split lies past the context and stays empty
    g = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + g  # [GROUP_PAD] query heads
    real_rows = g < GROUP  # [GROUP_PAD]: rows g >= GROUP are padding
    d = tl.arange(0, HEAD_DIM)[None, :]  # [1, HEAD_DIM]
    q_at = q_ptr + q_row * stride_qt + heads[:, None] * stride_qh + d
    q = tl.load(q_at, mask=real_rows[:, None], other=0.0)  # [GROUP_PAD, HEAD_DIM]
    row_max, row_sum, acc = attend_key_tiles(
        q,
        end - 1,  # every row sees the split's keys
        start,
        start,  # no unmasked tiles: every key is masked by end
        end,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr + seq * stride_bt,
        kv_head * stride_ch,
        stride_cb,
        stride_cs,
        qk_scale,
        BLOCK_SIZE,
        TILE_N,
    )
    # an empty split (row_max = -inf, row_sum = 0) reports lse = -inf, i.e. weight 0, and a zero output, not 0/0
    row_sum = tl.where(row_sum > 0, row_sum, 1.0)
    out = acc / row_sum[:, None]  # [GROUP_PAD, HEAD_DIM]
    real_head_rows = real_rows[:, None]  # [GROUP_PAD, 1]
    if ONE_SPLIT:  # the whole context was this split's: out is the answer
        out_at = out_ptr + q_row * stride_ot + heads[:, None] * stride_oh + d
        tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=real_head_rows)
    else:
        lse = row_max + tl.log2(row_sum)  # [GROUP_PAD] log2-sum-exp2 of this split's scores
        # partials are contiguous: part_lse [num_seqs, num_heads, num_splits], part_out [..., HEAD_DIM]
        head_row = seq * tl.num_programs(1) * GROUP + heads  # [GROUP_PAD]: rows of [num_seqs x num_heads]
        row = head_row * tl.num_programs(2) + split
        tl.store(part_lse_ptr + row, lse, mask=real_rows)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d, out, mask=real_head_rows)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    query_start_loc_ptr,
    stride_ph,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):
    # program (seq, head): merge one query head's partial outputs, each weighted by its split's share of the softmax
    # mass, 2^(lse_s - max lse), if seq is a decode (the split kernel wrote nothing for the others). The number of
    # splits arrives as part_out's head stride (num_splits * HEAD_DIM): Triton compiles a variant per integer argument
    # that is 1 or a multiple of 16, and a count would be either, or neither; this stride is always a multiple of 16,
    # so one variant serves every batch size (warm-up compiles it, and an eager run never waits for one).
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) - q_row != 1:
        return
    num_splits = stride_ph // HEAD_DIM
    s = tl.arange(0, MAX_SPLITS)
    d = tl.arange(0, HEAD_DIM)
    row = (seq * tl.num_programs(1) + head) * num_splits + s  # [MAX_SPLITS]
    real_splits = s < num_splits  # [MAX_SPLITS]: the others are padding
    lse = tl.load(part_lse_ptr + row, mask=real_splits, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # a context of 0 keys: every split is empty
    w = tl.exp2(lse - lse_max)[:, None]  # [MAX_SPLITS, 1], 0 for empty splits
    part_at = part_out_ptr + row[:, None] * HEAD_DIM + d[None, :]
    part = tl.load(part_at, mask=real_splits[:, None], other=0.0)  # [MAX_SPLITS, HEAD_DIM]
    total = tl.maximum(tl.sum(w, 0), 1e-30)  # [1]; a context of 0 keys: 0 / tiny = 0
    out = tl.sum(w * part, 0) / total  # [HEAD_DIM]
    out_at = out_ptr + q_row * stride_ot + head * stride_oh + d
    tl.store(out_at, out.to(out_ptr.dtype.element_ty))


def kernel_args(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> tuple:
    """What every attention kernel takes first: the query, the caches, the step's batch, the score scale (the
    kernels' softmax runs on exp2), then the strides of q, of the caches (block, slot, head: head_dim is contiguous)
    and of the block tables."""
    batch = (meta.block_tables, meta.query_start_loc, meta.context_lens)
    strides = (*q.stride()[:2], *k_cache.stride()[:3])  # (token, head), (block, slot, head)
    return (q, k_cache, v_cache, *batch, scale * LOG2E, *strides, meta.block_tables.stride(0))


def model_shape(q: Tensor, k_cache: Tensor) -> dict[str, int]:
    """The model's shape as the kernels' compile-time constants: query heads per KV head, head_dim, block size."""
    group = q.shape[1] // k_cache.shape[2]
    return {"GROUP": group, "HEAD_DIM": q.shape[2], "BLOCK_SIZE": k_cache.shape[1]}


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> Tensor:
    """q: [num_tokens, num_heads, head_dim] -> out, same shape: causal attention over each sequence's cached keys.
    The sequences with several queries (prefill chunks) go through the prefill kernel, those with one (decodes)
    through the split-KV kernel and its reduce: in a mixed step both launch, each skipping the other's sequences."""
    out = torch.empty_like(q)
    if not meta.decode_only:
        prefill(q, k_cache, v_cache, meta, scale, out)
    # the decodes: with one split (a batch that fills the GPU), the split kernel writes out itself; otherwise each
    # split writes its partial output and log-sum-exp and the reduce merges them into out. They launch in every step,
    # even one without decodes (they skip every sequence), so warm-up's prefill steps compile them.
    num_seqs = len(meta.context_lens)
    num_splits = decode_splits(num_seqs, k_cache.shape[2], num_sms(q.device))
    if num_splits == 1:
        decode_split(q, k_cache, v_cache, meta, scale, num_splits, out)
        return out
    part_out, part_lse = decode_split(q, k_cache, v_cache, meta, scale, num_splits)
    _decode_reduce_kernel[num_seqs, q.shape[1]](
        part_out,
        part_lse,
        out,
        meta.query_start_loc,
        part_out.stride(1),
        *out.stride()[:2],
        HEAD_DIM=q.shape[2],
        MAX_SPLITS=MAX_SPLITS,  # one variant for any number of splits
    )
    return out


def prefill(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: Tensor,
) -> None:
    """The prefill kernel over the step's sequences with several queries, into their rows of out. Query rows per
    program: short tiles when every query is short (small chunks), from MIN_DOT_ROWS up to PREFILL_TILE_M."""
    longest = triton.next_power_of_2(meta.max_query_len)
    tile_m = min(PREFILL_TILE_M[q.dtype.itemsize], max(MIN_DOT_ROWS, longest))
    num_tiles = triton.cdiv(meta.max_query_len, tile_m)
    grid = (num_tiles, len(meta.context_lens), q.shape[1])
    _prefill_kernel[grid](
        *kernel_args(q, k_cache, v_cache, meta, scale),
        out,
        *out.stride()[:2],
        **model_shape(q, k_cache),
        TILE_M=tile_m,
        TILE_N=PREFILL_TILE_N,
        num_warps=prefill_num_warps(tile_m, q.dtype.itemsize),
        num_stages=PREFILL_NUM_STAGES,
    )


def decode_split(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    num_splits: int,
    out: Tensor | None = None,
) -> tuple[Tensor, Tensor] | None:
    """The split-KV kernel over the step's decodes, each sequence's keys cut into num_splits runs. Given out (one
    split only), the split writes its rows of out and this returns None. Without, it returns the splits' partials,
    (part_out [num_seqs, num_heads, num_splits, head_dim], part_lse [num_seqs, num_heads, num_splits]) in fp32, for a
    merge: the reduce kernel's, or an extension's (ext/cascade.py merges them with its shared prefix's)."""
    num_seqs = len(meta.context_lens)
    num_tokens, num_heads, head_dim = q.shape
    partials = None
    if out is None:
        part_out = q.new_empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32)
        partials = (part_out, part_out.new_empty(part_out.shape[:3]))
        out = part_out  # (never written: the split writes partials)
    shape = model_shape(q, k_cache)
    _decode_split_kernel[num_seqs, k_cache.shape[2], num_splits](  # (sequence, KV head, split)
        *kernel_args(q, k_cache, v_cache, meta, scale),
        out,
        *out.stride()[:2],
        *(partials or (out, out)),  # (one split: the part pointers are never read)
        **shape,
        GROUP_PAD=decode_group_pad(shape["GROUP"]),
        TILE_N=DECODE_TILE_N[q.dtype.itemsize, k_cache.dtype.itemsize],
        ONE_SPLIT=partials is None,
        num_warps=DECODE_NUM_WARPS,
    )
    return partials


def prefill_tile_sizes(dtype: torch.dtype) -> list[int]:
    """Every query tile paged_attention can pick for a prefill: MIN_DOT_ROWS, twice that, ... up to PREFILL_TILE_M
    (16-bit: 16 ... 128; fp32: 16, 32)."""
    sizes = [MIN_DOT_ROWS]
    while sizes[-1] < PREFILL_TILE_M[dtype.itemsize]:
        sizes.append(sizes[-1] * 2)
    return sizes


def prefill_num_warps(tile_m: int, itemsize: int) -> int:
    """Warps of a prefill tile of tile_m query rows: 8 for a wide tile (16-bit: 2 warpgroups, each a 64-row wgmma on
    Hopper), else 4."""
    if tile_m >= PREFILL_WIDE_TILE_M[itemsize]:
        return 8
    return 4


def decode_group_pad(group: int) -> int:
    """Rows of the decode kernel's tl.dot: the GQA group (query heads sharing a KV head), padded to a power of two
    and to at least MIN_DOT_ROWS."""
    return max(MIN_DOT_ROWS, triton.next_power_of_2(group))


def decode_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """How many splits the decode grid cuts each sequence's keys into, from the batch alone, so a CUDA graph (one
    per batch size) can hold it. Unsplit, the grid has num_seqs * num_kv_heads programs: a small batch would leave
    most SMs idle, so the keys are split until about PROGRAMS_PER_SM programs per SM (at most MAX_SPLITS). The kernel
    then cuts each sequence's own context into that many runs of whole tiles (not whole blocks: keys find their
    block one by one), so a short context is split as finely as a long one, down to one tile per split."""
    return min(MAX_SPLITS, triton.cdiv(PROGRAMS_PER_SM * num_sms, num_seqs * num_kv_heads))


@functools.cache
def num_sms(device: torch.device) -> int:
    """The device's streaming multiprocessors (CPU_NUM_SMS under Triton's interpreter): what the decode grid fills."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_NUM_SMS


def store_kv_ref(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim]; writes each token's K/V into its slot."""
    keep = slot_mapping != PAD_SLOT
    slots = slot_mapping[keep]
    for new, cache in ((k, k_cache), (v, v_cache)):
        cache.flatten(0, 1)[slots] = new[keep].to(cache.dtype)  # fp8: saturating, to nearest


def reference_groups(meta: AttentionMetadata) -> list[slice]:
    """The step's sequences cut into runs that the PyTorch reference attends one at a time: it pads a run to its
    longest query and longest context, so a run's padded queries x keys stay under REFERENCE_RUN_SIZE (a sequence
    longer than that runs alone). Its memory then follows what the step attends, not its number of sequences times
    its longest prompt (warm-up's step of 8,192 prompt tokens beside 250 one-token sequences asked for 8 GiB as one
    run on a GPU). The lengths are read on the host: a sync on a GPU, where the reference is for checking."""
    q_lens = meta.query_start_loc.diff().tolist()
    k_lens = meta.context_lens.tolist()
    runs = []
    start = 0  # the current run's first sequence, and its longest query and context so far
    longest_q = 0
    longest_k = 0
    for i in range(len(k_lens)):
        longest_q = max(longest_q, q_lens[i])
        longest_k = max(longest_k, k_lens[i])
        if i > start and (i + 1 - start) * longest_q * longest_k > REFERENCE_RUN_SIZE:  # sequence i starts a run
            runs.append(slice(start, i))
            start = i
            longest_q = q_lens[i]
            longest_k = k_lens[i]
    return [*runs, slice(start, len(k_lens))]


def gather_for_reference(meta: AttentionMetadata, run: slice, block_size: int) -> tuple[Tensor, ...]:
    """How paged_attention_ref lays out one run of a step's sequences for SDPA: each sequence's keys gathered from its
    blocks into a batch padded to the run's longest context, its queries into one padded to its longest query, and a
    causal mask. It depends on the metadata only, so every layer of a step shares it (AttentionMetadata.
    reference_gather keeps every run's). Returns
      blocks        [seqs, max_k] cache block of each key; padding keys re-read the sequence's first one
      offsets       [seqs, max_k] its slot within that block
      visible       [seqs, 1, max_q, max_k] bool: which keys each query sees
      query_rows    [seqs, max_q] rows of q
      real_queries  [seqs, max_q] bool: not padding
    The mask is causal only: a real query sits inside its context, so the keys it sees do too; padding keys are
    seen by padding queries alone, whose rows are dropped."""
    context_lens = meta.context_lens[run]  # [seqs]
    starts = meta.query_start_loc[run.start : run.stop + 1]  # [seqs + 1]
    q_lens = starts.diff()[:, None]  # [seqs, 1]
    device = context_lens.device
    key_pos = torch.arange(context_lens.max().item(), device=device)  # [max_k]
    # padding keys re-read the sequence's first key (slots past a context may hold anything, even NaN)
    pos = torch.where(key_pos < context_lens[:, None], key_pos, 0)  # [seqs, max_k]
    blocks = meta.block_tables[run].gather(1, pos // block_size)  # [seqs, max_k]
    q_idx = torch.arange(q_lens.max().item(), device=device)  # [max_q]
    last_row = len(meta.slot_mapping) - 1
    query_rows = (starts[:-1, None] + q_idx).clamp(max=last_row)  # [seqs, max_q]; padding reads the last row
    q_pos = context_lens[:, None] - q_lens + q_idx  # [seqs, max_q] positions of the queries
    visible = key_pos <= q_pos[:, None, :, None]  # [seqs, 1, max_q, max_k]: causal
    return blocks, pos % block_size, visible, query_rows, q_idx < q_lens


def paged_attention_ref(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> Tensor:
    """q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim], causal within each sequence:
    PyTorch's SDPA over each sequence's keys gathered from its blocks (gather_for_reference), in fp32, one run of
    sequences at a time (reference_groups)."""
    if meta.reference_gather is None:  # the step's first layer
        runs = reference_groups(meta)
        meta.reference_gather = [gather_for_reference(meta, run, k_cache.shape[1]) for run in runs]
    out = torch.zeros_like(q)  # a context of 0 keys (a padded graph row) gives 0, as the kernels do
    for blocks, offsets, visible, query_rows, real_queries in meta.reference_gather:
        # the keys and values by (block, offset), [seqs, num_kv_heads, max_k, head_dim], and the queries,
        # [seqs, num_heads, max_q, head_dim]: SDPA's layout, in fp32
        k = k_cache[blocks, offsets].float().transpose(1, 2)
        v = v_cache[blocks, offsets].float().transpose(1, 2)
        queries = q[query_rows].float().transpose(1, 2)
        run_out = F.scaled_dot_product_attention(queries, k, v, attn_mask=visible, scale=scale, enable_gqa=True)
        # [tokens of the run, num_heads, head_dim]: padded query rows dropped; an empty context's NaN as 0
        run_out = run_out.transpose(1, 2)[real_queries].nan_to_num(0.0)
        out[query_rows[real_queries]] = run_out.to(q.dtype)
    return out
