"""Paged attention: attend through each sequence's block table to the K/V in the cache's slots.

The KV cache of one layer is two tensors [num_blocks, block_size, num_kv_heads, head_dim]; a sequence's tokens live in
the blocks its block table lists, in order, so physical blocks need not be contiguous (PagedAttention, Kwon et al.
2023). This step's K/V reach their slots first, stored by the kernel that rotates K (fused_ops.py: that program already
holds each token's K; `store_kv_ref` here is the store's reference). Then two Triton jobs: a flash-attention kernel
(FlashAttention-2, Dao 2023: query tiles, online softmax) serves the sequences with several queries (prefill chunks),
causal and varlen; a split-KV kernel (Flash-Decoding, Dao et al. 2023) serves the sequences with one query (decodes),
also inside a mixed step, by splitting each sequence's keys across programs and merging their partial softmaxes: the
last of a (sequence, KV head)'s split programs to finish merges them, so no second kernel runs. Each kernel skips
the other's sequences, so a mixed step is two launches over one metadata. Every key is read from the cache, so the
store runs before attention. The PyTorch references at the bottom are the oracle the kernels are tested against, and
the CPU's fast path. Words: a "block" is a KV-cache page, a "tile" a kernel's compute tile.

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
PREFILL_TILE_N = 64  # keys per step of the prefill loop
# ... of a wide tile's (8 warps) over a 16-bit cache: the tutorial's H100 choice again, half the loop's steps, each
# twice the work for the same softmax bookkeeping (242 registers, one program per SM as at 64); at 128 keys a 4-warp
# tile spills, and so does an fp8 cache's widened tile on triton 3.6
PREFILL_WIDE_TILE_N = 128
PREFILL_WIDE_TILE_M = {2: 128, 4: 16}  # prefill tiles of this many rows or more run on 8 warps (16-bit: 2 warpgroups)
PREFILL_NUM_STAGES = 3  # K/V tiles in flight in the prefill loop's software pipeline (Triton's default, named for
# bench_kernels.py's sweep)
DECODE_TILE_N = {(2, 2): 64, (2, 1): 32, (4, 4): 16, (4, 1): 16}  # keys per step of a decode split, by the query's
# and the cache's element sizes
DECODE_NUM_WARPS = 4
PROGRAMS_PER_SM = 4  # decode programs resident per SM at once (one wave): registers allow 4 on an H100 (107 each, 4
# warps, triton 3.6; shared memory would allow 5); decode_splits fills one wave
REFERENCE_RUN_SIZE = 1 << 24  # the PyTorch reference's padded queries x keys per SDPA call (reference_groups)
MAX_SPLITS = 32  # the merge holds all partials of a head, [MAX_SPLITS, head_dim] fp32, in registers (64 pushed the
# fp8-cache decode kernel to 143 registers on triton 3.6: 3 programs per SM, not 4; and at batch 1 the H100 measured
# 64 splits slower than fewer, 2026-11-27)
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
    # at least [num_seqs * num_kv_heads] int32 zeros, the decode merge's arrival counters (zero again after every
    # launch), or None: the step's first layer makes them, for every layer. The CUDA graphs keep one tensor, so a
    # replay allocates nothing
    split_counters: Tensor | None = None
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
def _attend_key_tiles(
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
        for n in range(unmasked_end if MASKED else start, end if MASKED else unmasked_end, TILE_N):
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
    tile, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
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
    q = tl.load(q_ptr + tokens * stride_qt + head * stride_qh + d, mask=real_rows, other=0.0)  # [TILE_M, HEAD_DIM]
    # Keys up to the tile's first query are seen by all its rows: whole tiles of them need no mask. Keys after
    # its last query are seen by none: stop there (skips the tiles above the diagonal).
    first_q_pos = ctx - q_len + tile * TILE_M  # the position of the tile's first query
    unmasked_end = (first_q_pos + 1) // TILE_N * TILE_N  # whole key tiles at positions <= first_q_pos
    kv_end = tl.minimum(ctx, first_q_pos + TILE_M)  # one past the tile's last query
    # then the diagonal, masked: the causal mask (a query sees the keys up to its own position) also hides keys
    # >= kv_end from real queries
    _, row_sum, acc = _attend_key_tiles(
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
    split_counters_ptr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
    MERGE: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    # program (seq, kv_head, split): the GROUP query heads sharing kv_head (rows of one tl.dot, so each K/V byte
    # is read once) attend to the split-th of num_splits equal runs of whole key tiles of sequence seq's context,
    # if seq has one query (a decode); its split length follows its own context, so a CUDA graph's fixed grid
    # keeps every split busy whatever the context. With ONE_SPLIT (a batch that fills the GPU by itself) the one
    # split's output is the answer: it goes straight to out; the part pointers are not used. Otherwise each split
    # writes its partial output and log-sum-exp, and with MERGE the last split of (seq, kv_head) to finish merges
    # them into out (without, the caller merges: ext/cascade.py).
    # DEPENDENT: launched as a programmatic dependent of the kernel before it (sm_90; ext/gemv.py asks for it, whose
    # weight reads surround attention at batch 1): let the next kernel's programs be placed now, so that they
    # prefetch their weights while this one runs, then wait until the kernel before has finished (its K/V stored),
    # before any load
    if DEPENDENT:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
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
    q = tl.load(
        q_ptr + q_row * stride_qt + heads[:, None] * stride_qh + d, mask=real_rows[:, None], other=0.0
    )  # [GROUP_PAD, HEAD_DIM]
    row_max, row_sum, acc = _attend_key_tiles(
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
    if ONE_SPLIT:  # the whole context was this split's: out is the answer
        out_at = out_ptr + q_row * stride_ot + heads[:, None] * stride_oh + d
        tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=real_rows[:, None])
    else:
        lse = row_max + tl.log2(row_sum)  # [GROUP_PAD] log2-sum-exp2 of this split's scores
        # partials are contiguous: part_lse [num_seqs, num_heads, num_splits], part_out [..., HEAD_DIM]
        row = (seq * tl.num_programs(1) * GROUP + heads) * tl.num_programs(2) + split  # [GROUP_PAD]
        tl.store(part_lse_ptr + row, lse, mask=real_rows)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d, out, mask=real_rows[:, None])
        if MERGE:
            # Arrive on (seq, kv_head)'s counter; the split that arrives last merges every split's partials. The
            # barrier first: all of this program's threads have stored. The add is acquire-release at GPU scope, so
            # the partials other programs stored before their add are visible to the last one after its own.
            tl.debug_barrier()
            counter = split_counters_ptr + seq * tl.num_programs(1) + kv_head
            num_splits = tl.num_programs(2)
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
                tl.store(counter, 0)  # zero again for the next layer (a CUDA graph replays the same counters)
                s = tl.arange(0, MAX_SPLITS)[:, None]  # [MAX_SPLITS, 1]; splits >= num_splits are padding
                for h in range(kv_head * GROUP, kv_head * GROUP + GROUP):  # each query head: its partials weighted
                    # by their splits' shares of the softmax mass, 2^(lse_s - max lse), summed in split order
                    # (whichever split merges); read past L1 (".cg"), which may hold an earlier launch's lines
                    part_row = (seq * tl.num_programs(1) * GROUP + h) * num_splits + s
                    lses = tl.load(part_lse_ptr + part_row, s < num_splits, float("-inf"), cache_modifier=".cg")
                    # (the max floored, so that a context of no keys, every lse -inf, weighs 0 and merges to 0)
                    w = tl.exp2(lses - tl.maximum(tl.max(lses, 0), -1e30))  # [MAX_SPLITS, 1]: 0 for an empty split
                    part = tl.load(part_out_ptr + part_row * HEAD_DIM + d, s < num_splits, 0.0, cache_modifier=".cg")
                    merged = tl.sum(w * part, 0) / tl.maximum(tl.sum(w, 0), 1e-30)  # [HEAD_DIM]
                    out_at = out_ptr + q_row * stride_ot + h * stride_oh + d
                    tl.store(out_at, merged[None, :].to(out_ptr.dtype.element_ty))


def paged_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float, dependent: bool = False
) -> Tensor:
    """q: [num_tokens, num_heads, head_dim] -> out, same shape: causal attention over each sequence's cached keys.
    The sequences with several queries (prefill chunks) go through the prefill kernel, those with one (decodes)
    through the split-KV kernel: in a mixed step both launch, each skipping the other's sequences. dependent (sm_90
    and later only): the split kernel launches as a programmatic dependent (ext/gemv.py's 4.)."""
    out = torch.empty_like(q)
    _, num_heads, head_dim = q.shape
    num_seqs, num_kv_heads = len(meta.context_lens), k_cache.shape[2]
    # what both attention kernels take first: the query, the caches, the step's batch, the score scale (the kernels'
    # softmax runs on exp2), then the strides of q, of the caches (block, slot, head: head_dim is contiguous) and of
    # the block tables; and the model's shape, as constexprs
    args = (
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.query_start_loc,
        meta.context_lens,
        scale * LOG2E,
        *q.stride()[:2],
        *k_cache.stride()[:3],
        meta.block_tables.stride(0),
    )
    shape = {"GROUP": num_heads // num_kv_heads, "HEAD_DIM": head_dim, "BLOCK_SIZE": k_cache.shape[1]}
    if not meta.decode_only:
        # query rows per program: short tiles when every query is short (small chunks), from MIN_DOT_ROWS up to the
        # query dtype's PREFILL_TILE_M
        tile_m = min(PREFILL_TILE_M[q.dtype.itemsize], max(MIN_DOT_ROWS, triton.next_power_of_2(meta.max_query_len)))
        warps, tile_n = prefill_tile(tile_m, q.dtype.itemsize, k_cache.dtype.itemsize)
        _prefill_kernel[triton.cdiv(meta.max_query_len, tile_m), num_seqs, num_heads](
            *args,
            out,
            *out.stride()[:2],
            **shape,
            TILE_M=tile_m,
            TILE_N=tile_n,
            num_warps=warps,
            num_stages=PREFILL_NUM_STAGES,
        )
    # the decodes: the split kernel writes each split's partial output and log-sum-exp, and the last split of each
    # (sequence, KV head) merges them into out; with one split (a batch that fills the GPU), the split kernel writes
    # out itself. It launches in every step, even one without decodes (it skips every sequence), so warm-up's prefill
    # steps compile it: its one-sequence steps the split variant, its biggest step the one-split variant if any batch
    # can have one split.
    num_splits = decode_splits(num_seqs, num_kv_heads, _num_sms(q.device))
    part_out = out.new_empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32) if num_splits > 1 else out
    part_lse = part_out.new_empty(part_out.shape[:3]) if num_splits > 1 else out  # (one split: unused)
    if meta.split_counters is None:  # (the graphs keep their own) made once per step, in its first layer, for all
        meta.split_counters = meta.context_lens.new_zeros(num_seqs * num_kv_heads)
    _decode_split_kernel[num_seqs, num_kv_heads, num_splits](
        *args,
        out,
        *out.stride()[:2],
        part_out,
        part_lse,
        meta.split_counters,
        **shape,
        GROUP_PAD=decode_group_pad(shape["GROUP"]),
        TILE_N=DECODE_TILE_N[q.dtype.itemsize, k_cache.dtype.itemsize],
        ONE_SPLIT=num_splits == 1,
        MERGE=True,
        MAX_SPLITS=MAX_SPLITS,
        DEPENDENT=dependent,
        num_warps=DECODE_NUM_WARPS,
        launch_pdl=dependent,
    )
    return out


def prefill_tile_sizes(dtype: torch.dtype) -> list[int]:
    """Every query tile paged_attention can pick for a prefill: MIN_DOT_ROWS, twice that, ... up to PREFILL_TILE_M
    (16-bit: 16 ... 128; fp32: 16, 32)."""
    sizes = [MIN_DOT_ROWS]
    while sizes[-1] < PREFILL_TILE_M[dtype.itemsize]:
        sizes.append(sizes[-1] * 2)
    return sizes


def prefill_tile(tile_m: int, itemsize: int, kv_itemsize: int) -> tuple[int, int]:
    """(warps, keys per step) of a prefill tile of tile_m query rows, for queries and a cache of these element sizes:
    a wide tile runs on 8 warps (16-bit: 2 warpgroups, each a 64-row wgmma on Hopper), and over a 16-bit cache steps
    PREFILL_WIDE_TILE_N keys; any other tile, 4 warps and PREFILL_TILE_N keys."""
    if tile_m < PREFILL_WIDE_TILE_M[itemsize]:
        return 4, PREFILL_TILE_N
    return 8, PREFILL_WIDE_TILE_N if kv_itemsize == 2 else PREFILL_TILE_N


def decode_group_pad(group: int) -> int:
    """Rows of the decode kernel's tl.dot: the GQA group (query heads sharing a KV head), padded to a power of two
    and to at least MIN_DOT_ROWS."""
    return max(MIN_DOT_ROWS, triton.next_power_of_2(group))


def decode_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """How many splits the decode grid cuts each sequence's keys into, from the batch alone, so a CUDA graph (one
    per batch size) can hold it. Unsplit, the grid has num_seqs * num_kv_heads programs: a small batch would leave
    most SMs idle, so the keys are split as finely as one wave allows, PROGRAMS_PER_SM programs per SM all running at
    once (at most MAX_SPLITS). Not one split more: a grid a little over one wave (9 splits at batch 8 on an H100, 576
    programs for 528 places) ends with a tail of programs streaming alone, at a fraction of the bandwidth. The kernel
    then cuts each sequence's own context into that many runs of whole tiles (not whole blocks: keys find their
    block one by one), so a short context is split as finely as a long one, down to one tile per split."""
    return max(1, min(MAX_SPLITS, PROGRAMS_PER_SM * num_sms // (num_seqs * num_kv_heads)))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_NUM_SMS


def store_kv_ref(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim]; writes each token's K/V into its slot."""
    keep = slot_mapping != PAD_SLOT
    for new, cache in ((k, k_cache), (v, v_cache)):
        cache.flatten(0, 1)[slot_mapping[keep]] = new[keep].to(cache.dtype)  # fp8: saturating, to nearest


def reference_groups(meta: AttentionMetadata) -> list[slice]:
    """The step's sequences cut into runs that the PyTorch reference attends one at a time: it pads a run to its
    longest query and longest context, so a run's padded queries x keys stay under REFERENCE_RUN_SIZE (a sequence
    longer than that runs alone). Its memory then follows what the step attends, not its number of sequences times
    its longest prompt (warm-up's step of 8,192 prompt tokens beside 250 one-token sequences asked for 8 GiB as one
    run on a GPU). The lengths are read on the host: a sync on a GPU, where the reference is for checking."""
    runs, start, longest_q, longest_k = [], 0, 0, 0
    lengths = zip(meta.query_start_loc.diff().tolist(), meta.context_lens.tolist(), strict=True)
    for i, (q_len, k_len) in enumerate(lengths):
        longest_q, longest_k = max(longest_q, q_len), max(longest_k, k_len)
        if i > start and (i + 1 - start) * longest_q * longest_k > REFERENCE_RUN_SIZE:  # sequence i starts a run
            runs.append(slice(start, i))
            start, longest_q, longest_k = i, q_len, k_len
    return [*runs, slice(start, len(meta.context_lens))]


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
    context_lens, starts = meta.context_lens[run], meta.query_start_loc[run.start : run.stop + 1]
    q_lens = starts.diff()[:, None]  # [seqs, 1]
    device = context_lens.device
    key_pos = torch.arange(context_lens.max().item(), device=device)  # [max_k]
    # padding keys re-read the sequence's first key (slots past a context may hold anything, even NaN)
    pos = torch.where(key_pos < context_lens[:, None], key_pos, 0)  # [seqs, max_k]
    blocks = meta.block_tables[run].gather(1, pos // block_size)  # [seqs, max_k]
    q_idx = torch.arange(q_lens.max().item(), device=device)  # [max_q]
    query_rows = (starts[:-1, None] + q_idx).clamp(max=len(meta.slot_mapping) - 1)  # [seqs, max_q]; padding: last
    q_pos = context_lens[:, None] - q_lens + q_idx  # [seqs, max_q] positions of the queries
    visible = key_pos <= q_pos[:, None, :, None]  # [seqs, 1, max_q, max_k]: causal
    return blocks, pos % block_size, visible, query_rows, q_idx < q_lens


def paged_attention_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
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
        k, v = (cache[blocks, offsets].float().transpose(1, 2) for cache in (k_cache, v_cache))
        queries = q[query_rows].float().transpose(1, 2)
        run_out = F.scaled_dot_product_attention(queries, k, v, attn_mask=visible, scale=scale, enable_gqa=True)
        # [tokens of the run, num_heads, head_dim]: padded query rows dropped; an empty context's NaN as 0
        out[query_rows[real_queries]] = run_out.transpose(1, 2)[real_queries].nan_to_num(0.0).to(q.dtype)
    return out
