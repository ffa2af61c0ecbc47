"""An extension: cascade attention, `LLM(..., cascade_attention=True)`. When the sequences of a decode step share their
leading KV blocks (the prefix cache makes them share a system prompt's blocks, by block id), plain paged attention
reads those blocks once per sequence: 256 requests behind a 2,048-token system prompt read the same 2,048 keys 256
times per layer and step. Cascade attention (vLLM V1's name) reads them once for all of them.

The idea is the log-sum-exp rule the split-KV decode kernel already uses to merge its splits. Attention over keys
[0, n) equals a merge of attention over [0, p) and over [p, n), each part reported as its output and its log-sum-exp:
out = (2^lse_a out_a + 2^lse_b out_b) / (2^lse_a + 2^lse_b). So one step of decode attention becomes:
  1. each sequence's own part, the keys after the shared blocks: the core's split kernel (attention.decode_split), run
     on block tables and context lengths that start after the shared blocks, writing its splits' partial outputs and
     log-sum-exps (even with one split: the merge needs them);
  2. the shared part: _shared_prefix_kernel below. One program takes TILE_M rows of (sequence, query head) of one KV
     head, queries of different sequences side by side as the rows of one matrix (which plain decode never has: it has
     one query per sequence), attends them to the shared keys with the core's key-tile loop
     (`attention.attend_key_tiles`), and folds in the sequence's partials from step 1 by the rule above, writing the
     answer.
Step 2 reads the shared keys once per TILE_M rows instead of once per sequence.

When: the runner calls this extension's step hook before every step. It looks at a decode-only step's block tables
(the longest run of leading block ids common to every sequence, limited to blocks wholly before each sequence's
newest token, which this step writes) and takes the cascade when it saves enough reads to pay for its extra launch:
(sequences - 1) x shared tokens >= MIN_SAVED_KEY_READS. Otherwise, and for any step with a prefill chunk, the model's
attention runs the core's plain path, unchanged. A cascaded step runs eagerly (the step hook says so): the decode CUDA
graphs were captured over the plain path (a step that reads 2k shared keys per sequence spends far longer on the GPU
than launching its kernels takes). The shared run is cut to a multiple of INTS_PER_16_BYTES blocks, so each
sequence's own block table (a view starting after it) stays 16-byte aligned, as every block table the kernels see
is: Triton compiles a variant per alignment, and an unaligned view would compile one in the middle of a run. On
kernels="torch" the cascade runs as its PyTorch reference, cascade_attention_ref, which the tests check the kernel
against, and both against the plain path."""

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from nanoserve.attention import (
    LOG2E,
    AttentionMetadata,
    attend_key_tiles,
    decode_split,
    decode_splits,
    num_sms,
)
from nanoserve.checks import InvalidField, check_flag
from nanoserve.config import EngineConfig
from nanoserve.scheduler import Step
from nanoserve.step_inputs import INTS_PER_16_BYTES
from nanoserve.triton_shim import tl, triton

if TYPE_CHECKING:
    from nanoserve.llm import LLM

FIELD = "cascade_attention"
# (sequences - 1) x shared tokens: the shared-key reads a cascade must save to be taken. Its cost is one more kernel
# per layer and the partials' round trip, a few microseconds on an H100; a shared token's K/V (Qwen3-0.6B: 4 KiB per
# layer) takes ~1.4 ns at 3 TB/s, so ~8k saved reads cover ~10 us.
MIN_SAVED_KEY_READS = 8192
SHARED_TILE_M = {2: 64, 4: 16}  # rows of (sequence, query head) per program, by the query's element size
SHARED_TILE_N = 64  # shared keys per step of the loop
SHARED_NUM_WARPS = 4  # one warpgroup: 64 rows x 128 head_dim of fp32 accumulator is 64 registers a thread


def check_config(config: EngineConfig) -> None:
    check_flag(FIELD, config.cascade_attention)
    if config.tensor_parallel_size > 1:
        raise InvalidField(FIELD, "nanoserve runs cascade attention with tensor_parallel_size=1 only")


def start(llm: "LLM") -> "Cascade":
    """The engine starts with cascade attention on: the model's paged attention goes through it, and its step hook
    joins the runner's. Returns the cascade (llm.extensions["cascade"])."""
    return Cascade(llm)


class Cascade:
    """The engine's cascade: this step's shared blocks (set by the step hook), read by every layer's attention."""

    def __init__(self, llm: "LLM") -> None:
        runner = llm.runner
        self.block_size = llm.config.kvcache_block_size
        self.enabled = True  # False: every step takes the plain path (bench.py --prefix compares the two)
        self.shared_blocks = 0  # this step's: the leading blocks all its decode sequences share; 0: the plain path
        self.suffix: tuple[AttentionMetadata, AttentionMetadata] | None = None  # (a step's metadata, its own parts')
        kernels = runner.model.kernels  # the backend the model was built with (kernels.py): Triton's or the references
        self.use_kernel = kernels.name == "triton"
        self.plain = kernels.paged_attention
        runner.model.replace_kernels(paged_attention=self.paged_attention)
        runner.step_hooks.append(self.before_step)

    def before_step(self, step: Step) -> bool:
        """The runner's step hook: how many leading blocks this step's sequences all share, if it is decode-only and
        the cascade pays; else 0. Returns whether the step cascades, and so must run eagerly."""
        seqs = [s.seq for s in step.scheduled]
        self.shared_blocks = 0
        if not self.enabled or len(seqs) < 2 or any(s.num_new_tokens != 1 for s in step.scheduled):
            return False
        tables = [seq.block_table for seq in seqs]
        # the lists' common prefix is that of the smallest and the largest (compared in C, not element by element)
        first = min(tables)
        last = max(tables)
        pairs = enumerate(zip(first, last, strict=False))
        shared = next((i for i, (a, b) in pairs if a != b), min(map(len, tables)))
        # only blocks wholly before every sequence's newest token (its K/V is written by this step)
        shared = min(shared, min((seq.num_computed_tokens - 1) // self.block_size for seq in seqs))
        shared -= shared % INTS_PER_16_BYTES  # the own tables' views stay 16-byte aligned (the module's docstring)
        if (len(seqs) - 1) * shared * self.block_size >= MIN_SAVED_KEY_READS:
            self.shared_blocks = shared
        return self.shared_blocks > 0

    def paged_attention(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float
    ) -> Tensor:
        """The model's paged attention: the cascade in a decode step that shares blocks, else the plain path."""
        if not (meta.decode_only and self.shared_blocks):
            return self.plain(q, k_cache, v_cache, meta, scale)
        if self.suffix is None or self.suffix[0] is not meta:  # made once per step, in its first layer
            self.suffix = (meta, suffix_metadata(meta, self.shared_blocks, k_cache.shape[1]))
        if self.use_kernel:
            cascade = cascade_attention
        else:
            cascade = cascade_attention_ref
        return cascade(q, k_cache, v_cache, meta, self.suffix[1], self.shared_blocks, scale)


def suffix_metadata(meta: AttentionMetadata, shared_blocks: int, block_size: int) -> AttentionMetadata:
    """The step's metadata for each sequence's own keys: its block table and context length after the shared blocks
    (the tables a view, each row still contiguous)."""
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        query_start_loc=meta.query_start_loc,
        context_lens=meta.context_lens - shared_blocks * block_size,
        block_tables=meta.block_tables[:, shared_blocks:],
        max_query_len=1,
        decode_only=True,
    )


@triton.jit
def _shared_prefix_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    shared_table_ptr,
    shared_len,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    part_out_ptr,
    part_lse_ptr,
    num_splits,
    num_rows,
    out_ptr,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_M: tl.constexpr,
    TILE_N: tl.constexpr,
):
    # program (kv_head, tile): TILE_M rows r = sequence * GROUP + g, the query heads of kv_head of consecutive decode
    # sequences (one query each: decode rows are sequences in order), attend to the shared keys [0, shared_len) through
    # the shared blocks' table (any sequence's: they are the same blocks), then merge the sequence's own partials
    r = tl.program_id(1) * TILE_M + tl.arange(0, TILE_M)  # [TILE_M]
    real_rows = r < num_rows
    seq = r // GROUP
    head = tl.program_id(0) * GROUP + r % GROUP
    d = tl.arange(0, HEAD_DIM)[None, :]  # [1, HEAD_DIM]
    q = tl.load(q_ptr + seq[:, None] * stride_qt + head[:, None] * stride_qh + d, mask=real_rows[:, None], other=0.0)
    row_max, row_sum, acc = attend_key_tiles(
        q,
        shared_len - 1,  # every row sees every shared key
        0,
        shared_len // TILE_N * TILE_N,  # whole tiles unmasked; the last, partial one masked
        shared_len,
        k_cache_ptr,
        v_cache_ptr,
        shared_table_ptr,
        tl.program_id(0) * stride_ch,
        stride_cb,
        stride_cs,
        qk_scale,
        BLOCK_SIZE,
        TILE_N,
    )
    # The parts, merged as they come: running max log-sum-exp (log2) m, the parts' weights 2^(lse - m) summed in w,
    # their outputs weighted the same in acc. First the shared part (weight 1 at its own lse), then each split.
    m = row_max + tl.log2(row_sum)  # [TILE_M]: row_sum > 0, the shared part has keys
    w = tl.full([TILE_M], 1.0, tl.float32)
    acc = acc / row_sum[:, None]  # [TILE_M, HEAD_DIM]
    part_row = (seq * tl.num_programs(0) * GROUP + head) * num_splits  # partials: [seq, head, split], contiguous
    for split in range(num_splits):
        lse = tl.load(part_lse_ptr + part_row + split, mask=real_rows, other=float("-inf"))  # -inf: an empty split
        part = tl.load(part_out_ptr + (part_row + split)[:, None] * HEAD_DIM + d, mask=real_rows[:, None], other=0.0)
        new_m = tl.maximum(m, lse)
        old_scale, part_scale = tl.exp2(m - new_m), tl.exp2(lse - new_m)
        w = w * old_scale + part_scale
        acc = acc * old_scale[:, None] + part * part_scale[:, None]
        m = new_m
    out_at = out_ptr + seq[:, None] * stride_ot + head[:, None] * stride_oh + d
    tl.store(out_at, (acc / w[:, None]).to(out_ptr.dtype.element_ty), mask=real_rows[:, None])


def cascade_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    suffix: AttentionMetadata,
    shared_blocks: int,
    scale: float,
) -> Tensor:
    """q: [num_seqs, num_heads, head_dim], one query per sequence (a decode-only step) whose first shared_blocks
    blocks are the same for all -> out, same shape: the plain path's answer, in two kernels (the module's docstring)."""
    out = torch.empty_like(q)
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    # 1) each sequence's own keys: the core's split kernel, its partials kept (never merged there)
    num_splits = decode_splits(num_seqs, num_kv_heads, num_sms(q.device))
    part_out, part_lse = decode_split(q, k_cache, v_cache, suffix, scale, num_splits)
    # 2) the shared keys, once per TILE_M rows of (sequence, query head), merged with the partials into out
    tile_m = SHARED_TILE_M[q.dtype.itemsize]
    _shared_prefix_kernel[num_kv_heads, triton.cdiv(num_seqs * group, tile_m)](
        q,
        k_cache,
        v_cache,
        meta.block_tables,  # row 0: the shared blocks are every row's first
        shared_blocks * block_size,
        scale * LOG2E,
        *q.stride()[:2],
        *k_cache.stride()[:3],
        part_out,
        part_lse,
        num_splits,
        num_seqs * group,
        out,
        *out.stride()[:2],
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        TILE_M=tile_m,
        TILE_N=SHARED_TILE_N,
        num_warps=SHARED_NUM_WARPS,
    )
    return out


def attend_with_lse(q: Tensor, k: Tensor, v: Tensor, valid: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """Plain attention in fp32, with its log-sum-exp: q [S, H, D] (a query per sequence) to keys and values k, v
    [S or 1, L, KV heads, D] (1: the same keys for every sequence), valid [S, L] (None: every key) -> output
    [S, H, D] and the natural log-sum-exp of each row's scores, [S, H]."""
    group = q.shape[1] // k.shape[2]
    k = k.float().repeat_interleave(group, dim=2).expand(len(q), -1, -1, -1)  # [S, L, H, D]
    v = v.float().repeat_interleave(group, dim=2).expand(len(q), -1, -1, -1)
    scores = torch.einsum("shd,slhd->shl", q.float(), k) * scale
    if valid is not None:  # keys past a context: never seen, and their slots may hold garbage (0 x NaN is NaN)
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        v = v.masked_fill(~valid[:, :, None, None], 0.0)
    lse = scores.logsumexp(-1)
    return torch.einsum("shl,slhd->shd", (scores - lse[..., None]).exp(), v), lse


def cascade_attention_ref(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    suffix: AttentionMetadata,
    shared_blocks: int,
    scale: float,
) -> Tensor:
    """cascade_attention in plain PyTorch: the shared keys' attention (the same keys for every sequence) and each
    sequence's own keys' attention, each with its log-sum-exp, merged by the rule of the module's docstring."""
    shared = meta.block_tables[0, :shared_blocks].long()
    out_shared, lse_shared = attend_with_lse(
        q, k_cache[shared].flatten(0, 1)[None], v_cache[shared].flatten(0, 1)[None], None, scale
    )
    own = suffix.block_tables.long()  # [S, blocks] (past each context: masked)
    positions = torch.arange(own.shape[1] * k_cache.shape[1], device=q.device)
    valid = positions[None, :] < suffix.context_lens[:, None]
    out_own, lse_own = attend_with_lse(q, k_cache[own].flatten(1, 2), v_cache[own].flatten(1, 2), valid, scale)
    top = torch.maximum(lse_shared, lse_own)
    w_shared, w_own = (lse_shared - top).exp()[..., None], (lse_own - top).exp()[..., None]
    return ((w_shared * out_shared + w_own * out_own) / (w_shared + w_own)).to(q.dtype)
