"""The decode attention of ext/latency: the core's split-KV kernel (Flash-Decoding, attention.py) without its reduce
kernel. The core's decode cuts each sequence's keys into splits, each split program writes its partial output and
log-sum-exp, and a second, small kernel merges them. Here the merge happens in the split kernel itself: each split
arrives on its (sequence, KV head)'s counter after writing its partials, and the split that arrives last merges them
all (in split order, whichever split it is, so the result is the same every time) and sets the counter back to 0.
One launch fewer per layer, and the merge's reads come from L2 just after the writes. The arrival is the GEMV's
handshake (gemv.py's 2.): a barrier, then an atomic add that is acquire-release at GPU scope, then the partials read
past L1 (`.cg`).

Launched as a programmatic dependent where the GPU has it (gemv.py's 4.): attention sits between q|k|v's GEMV (and
the rotation kernel) and o's GEMV, and o's programs can only be placed early, and prefetch their weight while
attention runs, if attention lets them: each program first lets the next kernel start, then waits for the kernel
before it (its K/V stored) before any load.

The split count is the one-wave floor (decode_splits): as many splits as fit one wave of PROGRAMS_PER_SM programs per
SM, never a split more (the core takes the ceiling, a grid a little over one wave: its reduce kernel does not care how
many splits there are). At most MAX_SPLITS, since the merging program holds all of a head's partials in registers. A
batch that fills the GPU by itself gets one split, which goes to the core's one-split kernel (it writes the output:
nothing to merge); prefill chunks go to the core's prefill kernel (attention.prefill)."""

import torch
from torch import Tensor

from nanoserve.attention import (
    DECODE_NUM_WARPS,
    DECODE_TILE_N,
    PROGRAMS_PER_SM,
    AttentionMetadata,
    attend_key_tiles,
    decode_group_pad,
    decode_split,
    kernel_args,
    model_shape,
    num_sms,
    prefill,
)
from nanoserve.triton_shim import tl, triton

# the merging program holds all partials of a head, [MAX_SPLITS, head_dim] fp32, in registers (64 pushed the fp8-cache
# kernel to 143 registers on triton 3.6: 3 programs per SM, not 4; and at batch 1 the H100 measured 64 splits slower
# than fewer, 2026-11-27)
MAX_SPLITS = 32


def decode_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """The splits of each sequence's keys: the most whose grid (num_seqs x num_kv_heads x splits programs) fits one
    wave of PROGRAMS_PER_SM programs per SM, at least 1 and at most MAX_SPLITS. From the batch alone, so a CUDA graph
    (one per batch size) holds it."""
    return max(1, min(MAX_SPLITS, PROGRAMS_PER_SM * num_sms // (num_seqs * num_kv_heads)))


class DecodeAttention:
    """The model's paged attention (the kernel table's entry) with the merged decode. The arrival counters are this
    object's: one int32 per (sequence, KV head) of a grid that splits (at most one wave's worth, since a grid of more
    gets one split), zero between launches, so the decode graphs replay them as they are."""

    def __init__(self, device: torch.device, dependent: bool) -> None:
        self.num_sms = num_sms(device)
        self.counters = torch.zeros(PROGRAMS_PER_SM * self.num_sms, dtype=torch.int32, device=device)
        self.dependent = dependent  # launch as a programmatic dependent (sm_90 and later)

    def __call__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
        """q: [num_tokens, num_heads, head_dim] -> out, same shape, as attention.paged_attention. The decode kernel
        launches in every step, even one without decodes (it skips every sequence), so warm-up compiles it."""
        out = torch.empty_like(q)
        if not meta.decode_only:
            prefill(q, k_cache, v_cache, meta, scale, out)
        num_seqs = len(meta.context_lens)
        num_splits = decode_splits(num_seqs, k_cache.shape[2], self.num_sms)
        if num_splits == 1:
            decode_split(q, k_cache, v_cache, meta, scale, 1, out)
            return out
        _, num_heads, head_dim = q.shape
        part_out = q.new_empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32)
        part_lse = part_out.new_empty(part_out.shape[:3])  # [num_seqs, num_heads, num_splits]
        shape = model_shape(q, k_cache)
        _decode_merge_kernel[num_seqs, k_cache.shape[2], num_splits](
            *kernel_args(q, k_cache, v_cache, meta, scale),
            out,
            *out.stride()[:2],
            part_out,
            part_lse,
            self.counters,
            **shape,
            GROUP_PAD=decode_group_pad(shape["GROUP"]),
            TILE_N=DECODE_TILE_N[q.dtype.itemsize, k_cache.dtype.itemsize],
            MAX_SPLITS=MAX_SPLITS,
            DEPENDENT=self.dependent,
            num_warps=DECODE_NUM_WARPS,
            launch_pdl=self.dependent,
        )
        return out


@triton.jit
def _decode_merge_kernel(
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
    counters_ptr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    # program (seq, kv_head, split), as the core's _decode_split_kernel: the GROUP query heads sharing kv_head attend
    # to the split-th of num_splits equal runs of whole key tiles of sequence seq's context, if seq is a decode
    if DEPENDENT:  # a programmatic dependent: let the next kernel's programs be placed, then wait for the one before
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    q_row = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) - q_row != 1:  # several queries: the prefill kernel's
        return
    ctx = tl.load(context_lens_ptr + seq)
    split_len = tl.cdiv(ctx, num_splits * TILE_N) * TILE_N
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
    lse = row_max + tl.log2(row_sum)  # [GROUP_PAD] log2-sum-exp2 of this split's scores
    # partials are contiguous: part_lse [num_seqs, num_heads, num_splits], part_out [..., HEAD_DIM]
    row = (seq * tl.num_programs(1) * GROUP + heads) * num_splits + split  # [GROUP_PAD]
    tl.store(part_lse_ptr + row, lse, mask=real_rows)
    out = acc / row_sum[:, None]  # [GROUP_PAD, HEAD_DIM]
    tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d, out, mask=real_rows[:, None])
    # Arrive on (seq, kv_head)'s counter; the split that arrives last merges every split's partials. The barrier
    # first: all of this program's threads have stored. The add is acquire-release at GPU scope, so the partials other
    # programs stored before their add are visible to the last one after its own.
    tl.debug_barrier()
    counter = counters_ptr + seq * tl.num_programs(1) + kv_head
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
        tl.store(counter, 0)  # zero again for the next layer (a CUDA graph replays the same counters)
        s = tl.arange(0, MAX_SPLITS)[:, None]  # [MAX_SPLITS, 1]; splits >= num_splits are padding
        for h in range(kv_head * GROUP, kv_head * GROUP + GROUP):
            # each query head: its partials weighted by their splits' shares of the softmax mass, 2^(lse_s - max
            # lse), summed in split order; read past L1 (".cg"), which may hold an earlier launch's lines
            part_row = (seq * tl.num_programs(1) * GROUP + h) * num_splits + s  # [MAX_SPLITS, 1]
            real_splits = s < num_splits
            lses = tl.load(part_lse_ptr + part_row, mask=real_splits, other=float("-inf"), cache_modifier=".cg")
            # the max floored, so that a context of no keys (every lse -inf) weighs 0 and merges to 0
            lse_max = tl.maximum(tl.max(lses, 0), -1e30)
            w = tl.exp2(lses - lse_max)  # [MAX_SPLITS, 1]: 0 for an empty split
            parts = part_out_ptr + part_row * HEAD_DIM + d
            part = tl.load(parts, mask=real_splits, other=0.0, cache_modifier=".cg")  # [MAX_SPLITS, HEAD_DIM]
            total = tl.maximum(tl.sum(w, 0), 1e-30)
            merged = tl.sum(w * part, 0) / total  # [HEAD_DIM]
            out_at = out_ptr + q_row * stride_ot + h * stride_oh + d
            tl.store(out_at, merged[None, :].to(out_ptr.dtype.element_ty))
