"""Paged attention: write this step's K/V into their cache slots, then attend through each sequence's block table.

The KV cache of one layer is two tensors [num_blocks, block_size, num_kv_heads, head_dim]; a sequence's tokens live in
the blocks its block table lists, in order, so physical blocks need not be contiguous (PagedAttention, Kwon et al.
2023). Three Triton jobs: `store_kv` scatters this step's K/V into their slots; a flash-attention kernel
(FlashAttention-2, Dao 2023: query tiles, online softmax) serves prefill and mixed batches, causal and varlen; a
split-KV kernel (Flash-Decoding, Dao et al. 2023) serves decode-only batches by splitting each sequence's keys across
programs and merging their partial softmaxes in a small reduce kernel. Every key is read from the cache, so store_kv
runs before attention. The PyTorch references at the bottom are the oracle the kernels are tested against, and the CPU's
fast path. Words: a "block" is a KV-cache page, a "tile" a kernel's compute tile."""

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoserve.kernels import tl, triton

PAD_SLOT = -1  # slot_mapping value of a padded token: the KV store skips it
LOG2E = 1.4426950408889634  # log2(e) = 1/ln(2): softmax runs on exp2, so the score scale absorbs it
MIN_DOT_ROWS = 16  # tl.dot needs >= 16 rows: small query tiles and decode GQA groups are padded up to this
PREFILL_TILE_M = 128  # query rows per prefill program (the Triton fused-attention tutorial's H100 choice)
PREFILL_TILE_N = 64  # keys per step of the prefill loop
DECODE_TILE_N = 64  # keys per step of a decode split
DECODE_NUM_WARPS = 4
PROGRAMS_PER_SM = 4  # decode splits the keys until the grid has about this many programs per SM
MAX_SPLITS = 64  # the reduce kernel holds all partials of a head, [splits, head_dim] fp32, in registers
CPU_NUM_SMS = 4  # SM count assumed under TRITON_INTERPRET: small, yet CPU tests still see several splits
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)  # powers of two; 256 would overflow the registers of a 128-row tile


@dataclass
class AttentionMetadata:
    """One step's batch as attention sees it: built once per step by the runner, checked here, passed to every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] int32: block_id * block_size + offset, or PAD_SLOT
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: sequence i's queries are rows [qsl[i], qsl[i+1])
    context_lens: torch.Tensor  # [num_seqs] int32: keys per sequence after this step (cached + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    max_query_len: int  # host-side bounds, so launching a kernel never reads the GPU
    max_context_len: int  # >= every context_len (decode under a CUDA graph: max_model_len)
    decode_only: bool  # every sequence has exactly one query token

    def __post_init__(self):
        num_seqs = self.context_lens.shape[0]
        for t in (self.slot_mapping, self.query_start_loc, self.context_lens, self.block_tables):
            assert t.dtype == torch.int32 and t.device == self.context_lens.device, "metadata: int32, one device"
        assert self.query_start_loc.shape == (num_seqs + 1,) and self.block_tables.shape[0] == num_seqs
        assert self.block_tables.stride(1) == 1
        assert not self.decode_only or self.slot_mapping.shape[0] == num_seqs, "decode: one query per sequence"


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,  # k, v: [num_tokens, num_kv_heads, head_dim]
    stride_cb,
    stride_cs,
    stride_ch,  # caches: [num_blocks, block_size, num_kv_heads, head_dim]
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PAD: tl.constexpr,
):
    # program t copies token t's K and V, all KV heads at once, into its slot
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot == PAD:
        return
    h, d = tl.arange(0, HEADS_PAD)[:, None], tl.arange(0, HEAD_DIM)[None, :]
    mask = h < NUM_KV_HEADS  # [HEADS_PAD, 1]
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + d
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask), mask=mask)


@triton.jit
def _load_kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    pos,
    kv_end,
    kv_head,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
):
    """K and V at key positions pos [TILE_N] of one sequence, via its block table -> two [TILE_N, HEAD_DIM].
    Each position looks up its own block, so a tile may span several small blocks or part of a big one.
    MASKED: positions >= kv_end load 0, since their slots may hold garbage and 0 * garbage can be NaN;
    a tile known to lie below kv_end skips the predicates."""
    offs = tl.arange(0, HEAD_DIM)[None, :] + kv_head * stride_ch + (pos % BLOCK_SIZE)[:, None] * stride_cs
    if MASKED:
        valid = pos < kv_end
        block = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)  # [TILE_N]
        offs += block[:, None] * stride_cb
        k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0)
    else:
        offs += tl.load(block_table_ptr + pos // BLOCK_SIZE).to(tl.int64)[:, None] * stride_cb
        k = tl.load(k_cache_ptr + offs)
        v = tl.load(v_cache_ptr + offs)
    return k, v


@triton.jit
def _online_softmax_step(acc, m, l, q, k, v, visible, qk_scale, MASKED: tl.constexpr):
    """Fold one key tile into the running softmax of each query row (flash attention).
    acc [M, HEAD_DIM] fp32 unnormalised output, m [M] running max score, l [M] running sum of exp2(score - m);
    q [M, HEAD_DIM], k and v [N, HEAD_DIM], visible [M, N] (or broadcastable) which keys each row may see,
    read only if MASKED. Every row must see a key by its first tile, or its max stays -inf and the rescale is NaN."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [M, N] scores in log2 units; fp32 not tf32
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)  # rescales what was summed under the old max
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, m_new, l


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
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
    if tile * TILE_M >= q_len:  # the grid is sized for the longest query; this one is shorter
        return
    ctx = tl.load(context_lens_ptr + seq)
    rows = tile * TILE_M + tl.arange(0, TILE_M)  # [TILE_M] query index within the sequence
    q_pos = ctx - q_len + rows  # the queries are the sequence's last tokens
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=(rows < q_len)[:, None],
        other=0.0,
    )  # [TILE_M, HEAD_DIM]
    m, l = tl.full([TILE_M], float("-inf"), tl.float32), tl.zeros([TILE_M], tl.float32)  # running max, sum
    acc = tl.zeros([TILE_M, HEAD_DIM], tl.float32)
    block_table_ptr = block_tables_ptr + seq * stride_bt
    # Keys up to the tile's first query are seen by all its rows: whole tiles of them need no mask. Keys after
    # its last query are seen by none: stop there (skips the tiles above the diagonal).
    unmasked_end = (ctx - q_len + tile * TILE_M + 1) // TILE_N * TILE_N
    kv_end = tl.minimum(ctx, ctx - q_len + (tile + 1) * TILE_M)
    for n in range(0, unmasked_end, TILE_N):
        pos = n + tl.arange(0, TILE_N)  # [TILE_N] key positions
        k, v = _load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            block_table_ptr,
            pos,
            kv_end,
            head // GROUP,
            stride_cb,
            stride_cs,
            stride_ch,
            BLOCK_SIZE,
            HEAD_DIM,
            MASKED=False,
        )
        acc, m, l = _online_softmax_step(acc, m, l, q, k, v, None, qk_scale, MASKED=False)
    for n in range(unmasked_end, kv_end, TILE_N):  # the diagonal: causal mask and context end
        pos = n + tl.arange(0, TILE_N)
        k, v = _load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            block_table_ptr,
            pos,
            kv_end,
            head // GROUP,
            stride_cb,
            stride_cs,
            stride_ch,
            BLOCK_SIZE,
            HEAD_DIM,
            MASKED=True,
        )
        acc, m, l = _online_softmax_step(acc, m, l, q, k, v, pos[None, :] <= q_pos[:, None], qk_scale, MASKED=True)
    tl.store(
        out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
        (acc / l[:, None]).to(out_ptr.dtype.element_ty),
        mask=(rows < q_len)[:, None],
    )


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    part_out_ptr,
    part_lse_ptr,
    block_tables_ptr,
    context_lens_ptr,
    qk_scale,
    split_len,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
):
    # program (seq, kv_head, split): the GROUP query heads sharing kv_head (rows of one tl.dot, so each K/V byte
    # is read once) attend to keys [split * split_len, (split + 1) * split_len) of sequence seq (= q row seq)
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)  # <= start: the split lies past the context and stays empty
    g = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + g  # [GROUP_PAD] query heads; rows g >= GROUP are padding
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=(g < GROUP)[:, None], other=0.0
    )  # [GROUP_PAD, HEAD_DIM]
    m, l = tl.full([GROUP_PAD], float("-inf"), tl.float32), tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for n in range(start, end, TILE_N):
        pos = n + tl.arange(0, TILE_N)
        k, v = _load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            block_tables_ptr + seq * stride_bt,
            pos,
            end,
            kv_head,
            stride_cb,
            stride_cs,
            stride_ch,
            BLOCK_SIZE,
            HEAD_DIM,
            MASKED=True,
        )
        acc, m, l = _online_softmax_step(acc, m, l, q, k, v, (pos < end)[None, :], qk_scale, MASKED=True)
    # an empty split (m = -inf, l = 0) reports lse = -inf, i.e. weight 0, and a zero output instead of 0/0
    l = tl.where(l > 0, l, 1.0)
    lse = m + tl.log2(l)  # [GROUP_PAD] log2-sum-exp2 of this split's scores
    out = acc / l[:, None]
    # partials are contiguous: part_lse [num_seqs, num_heads, num_splits], part_out [..., HEAD_DIM]
    row = (seq * tl.num_programs(1) * GROUP + heads) * tl.num_programs(2) + split  # [GROUP_PAD]
    tl.store(part_lse_ptr + row, lse, mask=g < GROUP)
    tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=(g < GROUP)[:, None])


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    # program (seq, head): merge one query head's partial outputs, each weighted by its split's share of the
    # softmax mass, 2^(lse_s - max lse)
    seq, head = tl.program_id(0), tl.program_id(1)
    s, d = tl.arange(0, SPLITS_PAD), tl.arange(0, HEAD_DIM)
    row = (seq * tl.num_programs(1) + head) * num_splits + s  # [SPLITS_PAD]
    lse = tl.load(part_lse_ptr + row, mask=s < num_splits, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # context_len 0: every split is empty
    w = tl.exp2(lse - lse_max)  # [SPLITS_PAD], 0 for empty splits
    part = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=(s < num_splits)[:, None], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(total > 0, total, 1.0)  # [HEAD_DIM]; 0 if context_len 0
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def store_kv(k, v, k_cache, v_cache, slot_mapping):
    """k, v: [num_tokens, num_kv_heads, head_dim] -> into their slots of k_cache, v_cache; PAD_SLOT tokens skipped."""
    num_tokens, num_kv_heads, head_dim = k.shape
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *k_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        PAD=PAD_SLOT,
    )


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
    """q: [num_tokens, num_heads, head_dim] -> out, same shape: causal attention over each sequence's cached keys."""
    out = torch.empty_like(q)
    (_launch_decode if meta.decode_only else _launch_prefill)(q, k_cache, v_cache, out, meta, scale * LOG2E)
    return out


def _launch_prefill(q, k_cache, v_cache, out, meta, qk_scale):
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    # short query tiles when every query is short (mixed batches of decodes and small chunks)
    tile_m = min(PREFILL_TILE_M, max(MIN_DOT_ROWS, triton.next_power_of_2(meta.max_query_len)))
    grid = (triton.cdiv(meta.max_query_len, tile_m), meta.context_lens.shape[0], num_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        meta.block_tables,
        meta.query_start_loc,
        meta.context_lens,
        qk_scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *k_cache.stride()[:3],
        meta.block_tables.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        TILE_M=tile_m,
        TILE_N=PREFILL_TILE_N,
        num_warps=prefill_num_warps(tile_m),
    )


def prefill_num_warps(tile_m: int) -> int:
    return 8 if tile_m >= 128 else 4  # 8 warps = 2 warpgroups, each a 64-row wgmma on Hopper


def _launch_decode(q, k_cache, v_cache, out, meta, qk_scale):
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    split_len, num_splits = decode_splits(num_seqs, num_kv_heads, meta.max_context_len, _num_sms(q.device))
    part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        part_out,
        part_lse,
        meta.block_tables,
        meta.context_lens,
        qk_scale,
        split_len,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        meta.block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=max(MIN_DOT_ROWS, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        TILE_N=DECODE_TILE_N,
        num_warps=DECODE_NUM_WARPS,
    )
    _decode_reduce_kernel[(num_seqs, num_heads)](
        part_out,
        part_lse,
        out,
        num_splits,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
    )


def decode_splits(num_seqs, num_kv_heads, max_context_len, num_sms) -> tuple[int, int]:
    """(keys per split, number of splits) of the decode grid, from host ints only so a CUDA graph can hold it.
    Unsplit, the grid has num_seqs * num_kv_heads programs: a small batch with long contexts would leave most
    SMs idle, so the keys are split until about PROGRAMS_PER_SM programs per SM. A split covers whole tiles
    (not whole blocks: keys find their block one by one); splits past a sequence's context stay empty."""
    wanted = min(MAX_SPLITS, triton.cdiv(PROGRAMS_PER_SM * num_sms, num_seqs * num_kv_heads))
    max_context_len = max(max_context_len, 1)
    split_len = triton.cdiv(max_context_len, wanted * DECODE_TILE_N) * DECODE_TILE_N
    return split_len, triton.cdiv(max_context_len, split_len)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else CPU_NUM_SMS


def store_kv_ref(k, v, k_cache, v_cache, slot_mapping):
    """k, v: [num_tokens, num_kv_heads, head_dim]; writes each token's K/V into its slot."""
    keep = slot_mapping != PAD_SLOT
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]


def paged_attention_ref(q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
    """q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim], causal within each sequence.
    Each sequence's keys are gathered from its blocks into a batch padded to the longest context, its queries into one
    padded to the longest query, and PyTorch's SDPA attends under a mask that is causal and hides the padding."""
    block_size, device = k_cache.shape[1], q.device
    q_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]  # [num_seqs]
    key_pos = torch.arange(meta.max_context_len, device=device)  # [max_k]
    # padding keys re-read the sequence's own keys (slots past a context may hold anything, even NaN); masked below
    pos = torch.minimum(key_pos, (meta.context_lens[:, None] - 1).clamp(min=0))  # [num_seqs, max_k]
    slots = meta.block_tables.gather(1, pos // block_size) * block_size + pos % block_size
    k = k_cache.flatten(0, 1)[slots].float()  # [num_seqs, max_k, num_kv_heads, head_dim]
    v = v_cache.flatten(0, 1)[slots].float()
    q_idx = torch.arange(meta.max_query_len, device=device)  # [max_q]
    rows = (meta.query_start_loc[:-1, None] + q_idx).clamp(max=q.shape[0] - 1)  # [num_seqs, max_q] rows of q
    q_pos = (meta.context_lens - q_lens)[:, None] + q_idx  # [num_seqs, max_q] positions of the queries
    visible = (key_pos <= q_pos[..., None]) & (key_pos < meta.context_lens[:, None, None])  # [num_seqs, max_q, max_k]
    out = F.scaled_dot_product_attention(
        q[rows].float().transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=visible[:, None],
        scale=scale,
        enable_gqa=True,
    )
    out = out.transpose(1, 2)[q_idx < q_lens[:, None]]  # padded query rows dropped
    return out.nan_to_num(0.0).to(q.dtype)  # a context of 0 keys (a padded graph row) gives 0, as the kernels do
