"""An extension, found by name whenever kernels="triton" (kernels.py asks for it; the default on a GPU): kernel fusion.
The core runs a decoder layer's small elementwise work and the sampler's draw as plain PyTorch (layer_ops.py,
sampler.py: each a few PyTorch kernels); this file gives each of them one Triton kernel, same meaning:
  - residual add + RMSNorm (the sum written back in place as the next residual stream);
  - Qwen3's per-head QK-norm + RoPE, with this step's K/V stored into their cache slots by the same program (it
    already holds each token's rotated K): how the K/V reach the cache before attention reads it;
  - SiLU(gate) * up;
  - the sampler's draw, argmax(logits / T + Gumbel noise): one pass over each row's logits, the noise made in
    registers from the row's seed.

Why it matters: a decode step moves little data per kernel, so each kernel costs its fixed few microseconds on the GPU
even inside a CUDA graph; unfused, a Qwen3 layer launched about 70 kernels, fused it launches 11 (the H100 run of
2026-11-27 measured the fused path). The fused kernels are also what lets the decode step be captured in a CUDA graph:
the references' K/V store picks its rows on the host, so without this extension the engine runs eagerly (config.py).

Statistics are in fp32, and RMSNorm and SiLU round to the model dtype where transformers does. RoPE is computed in fp32
and rounded once, which is more accurate than transformers' bf16 products (they differ by one bf16 step in about a
third of elements). Kernels match their references (layer_ops.py, sampler.gumbel_argmax_ref) to within rounding
(summation order, the GPU's fast square root), not bit for bit; the sampler's kernel draws different (equally valid)
samples for a seed than its reference does, whose noise comes from a seeded generator per row."""

import torch
from torch import Tensor

from nanoserve.attention import PAD_SLOT
from nanoserve.sampler import to_device
from nanoserve.triton_shim import tl, triton

SILU_BLOCK = 1024  # columns per program of the SiLU kernel
RMS_NORM_ELEMENTS_PER_WARP = 256  # 8 a thread: one 16-byte bf16 load each
RMS_NORM_MAX_WARPS = 16  # reached at 4k columns; wider rows give each thread more elements
GUMBEL_TILE = 1024  # vocabulary entries per program of the sampling kernel: ~150 programs per row of a 152k vocabulary


def kernels() -> dict:
    """The kernel table's entries (kernels.Kernels' fields) this extension replaces, by name."""
    return {
        "add_rms_norm": add_rms_norm,
        "qk_norm_rope_store_kv": qk_norm_rope_store_kv,
        "silu_and_mul": silu_and_mul,
        "gumbel_argmax": gumbel_argmax,
    }


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, out_ptr, weight_ptr, stride_x, stride_r, n, eps, BLOCK: tl.constexpr):
    # program r: row r's residual stream becomes x + residual (written back in place), then is normalised into row r
    # of out (contiguous: made by the launcher). A product or sum of two model-dtype numbers is computed as torch
    # does, rounded once to the model dtype (Triton keeps fp16 arithmetic in fp16); statistics are fp32.
    row, cols = tl.program_id(0), tl.arange(0, BLOCK)
    mask = cols < n
    stream_ptrs = residual_ptr + row * stride_r + cols  # read, then overwritten with the sum
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    stream = x + tl.load(stream_ptrs, mask=mask, other=0.0)
    tl.store(stream_ptrs, stream, mask=mask)
    xf = stream.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
    w = tl.load(weight_ptr + cols, mask=mask)  # masked columns are never stored: no `other` needed
    tl.store(out_ptr + row * n + cols, (xf * inv_rms).to(x.dtype) * w, mask=mask)  # rounded before the weight, as HF


@triton.jit
def _norm_rope_heads(
    ptr,
    stride_h,
    num_heads,
    weight_ptr,
    cos,
    sin,
    eps,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
):
    """In place on one token's heads [num_heads, 2 * HALF] at ptr: per-head RMSNorm with the weight at weight_ptr
    (skipped when it is None: a compile-time constant), then rotate-half RoPE with this position's cos and sin
    [HALF] (fp32). Returns the two rotated halves as stored, [HEADS_PAD, HALF] each in the heads' dtype."""
    h, d = tl.arange(0, HEADS_PAD)[:, None], tl.arange(0, HALF)[None, :]
    mask = h < num_heads
    first = ptr + h * stride_h + d  # [HEADS_PAD, HALF] pointers to each head's first half; its second: first + HALF
    # a padded head's lanes (masked) are loaded as anything and never stored; sums run within a head, never across
    x1 = tl.load(first, mask=mask).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask).to(tl.float32)
    if weight_ptr is not None:
        sum_sq = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)  # [HEADS_PAD] over both halves: the whole head
        inv_rms = 1.0 / tl.sqrt(sum_sq / (2 * HALF) + eps)[:, None]
        w1, w2 = tl.load(weight_ptr + d), tl.load(weight_ptr + HALF + d)  # in the model dtype
        # as RMSNorm rounds: the normed head to the model dtype, then its product with the weight, in that dtype
        x1 = ((x1 * inv_rms).to(w1.dtype) * w1).to(tl.float32)
        x2 = ((x2 * inv_rms).to(w2.dtype) * w2).to(tl.float32)
    # the fp32 rotation, rounded once to the heads' dtype
    y1 = (x1 * cos - x2 * sin).to(ptr.dtype.element_ty)
    y2 = (x2 * cos + x1 * sin).to(ptr.dtype.element_ty)
    tl.store(first, y1, mask=mask)
    tl.store(first + HALF, y2, mask=mask)
    return y1, y2


@triton.jit
def _qk_norm_rope_store_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,  # caches: [num_blocks, block_size, num_kv_heads, head_dim]
    num_q_heads,
    num_k_heads,
    eps,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PAD: tl.constexpr,
):
    # program t: every q and k head of token t, which share its position's cos and sin; then token t's K, as rotated
    # (still in registers), and V into its cache slot, unless it is a padded token (slot PAD: it stores nothing)
    t = tl.program_id(0)
    pos = tl.load(positions_ptr + t)  # int32: pos * HALF stays far below 2**31
    row = pos * HALF + tl.arange(0, HALF)[None, :]  # this position's row of the cos and sin tables
    cos, sin = tl.load(cos_ptr + row), tl.load(sin_ptr + row)
    _norm_rope_heads(q_ptr + t * stride_qt, stride_qh, num_q_heads, q_weight_ptr, cos, sin, eps, Q_HEADS_PAD, HALF)
    k1, k2 = _norm_rope_heads(
        k_ptr + t * stride_kt, stride_kh, num_k_heads, k_weight_ptr, cos, sin, eps, K_HEADS_PAD, HALF
    )
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    h, d = tl.arange(0, K_HEADS_PAD)[:, None], tl.arange(0, HALF)[None, :]
    mask = h < tl.where(slot == PAD, 0, num_k_heads)  # [K_HEADS_PAD, 1]: a padded token stores no head
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + d  # first halves
    v = v_ptr + t * stride_vt + h * stride_vh + d
    # (the store casts to the cache's dtype: fp8 rounds from the model dtype's value, as a separate store would)
    tl.store(k_cache_ptr + dst, k1, mask=mask)
    tl.store(k_cache_ptr + dst + HALF, k2, mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst + HALF, tl.load(v + HALF, mask=mask), mask=mask)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, n, BLOCK: tl.constexpr):
    # program (row, chunk): out = silu(gate) * up for BLOCK columns, where x's row is [gate | up] and out is
    # contiguous (made by the launcher)
    row, chunk = tl.program_id(0), tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate_ptrs = x_ptr + row * stride_x + cols
    gate = tl.load(gate_ptrs, mask=mask)  # masked columns are never stored: no `other` needed
    up = tl.load(gate_ptrs + n, mask=mask)  # up's columns: n after gate's
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # silu in fp32, rounded as F.silu's output is
    tl.store(out_ptr + row * n + cols, act * up, mask=mask)  # in the model dtype: one rounding, as torch's product


@triton.jit
def _gumbel_argmax_kernel(
    logits_ptr, stride, temperature_ptr, seed_ptr, chunk_best_ptr, chunk_id_ptr, vocab_size, TILE: tl.constexpr
):
    # program (row, chunk): the best entry of the row's columns [chunk * TILE, (chunk + 1) * TILE) by
    # logits / T - log(E) with E ~ Exp(1) (the argmax over all chunks is a draw from softmax(logits / T)); by the
    # plain logits when T = 0. The best value and its column go to chunk_best and chunk_id, [rows, chunks].
    row, chunk = tl.program_id(0), tl.program_id(1)
    temperature, seed = tl.load(temperature_ptr + row), tl.load(seed_ptr + row)
    cols = chunk * TILE + tl.arange(0, TILE)
    x = tl.load(logits_ptr + row * stride + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
    if temperature > 0:
        # one Philox call (counter c // 4) gives the uniforms of columns c .. c + 3: a column's noise depends only on
        # (seed, column), never on the tile size
        u0, u1, u2, u3 = tl.rand4x(seed, chunk * (TILE // 4) + tl.arange(0, TILE // 4))  # 4 x [TILE / 4] in [0, 1)
        u = tl.interleave(tl.interleave(u0, u2), tl.interleave(u1, u3))  # [TILE]: u0[0], u1[0], u2[0], u3[0], u0[1]..
        x = x / temperature - tl.log(-tl.log(u))  # -log(u) ~ Exp(1); -log of that is Gumbel noise
    best, best_col = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)  # first of equal maxima
    out = row * tl.num_programs(1) + chunk  # (row, chunk) in the [rows, chunks] outputs
    tl.store(chunk_best_ptr + out, best)
    tl.store(chunk_id_ptr + out, chunk * TILE + best_col)


def rms_norm_num_warps(block: int) -> int:
    """Warps for a row of `block` columns: RMS_NORM_ELEMENTS_PER_WARP each, from 1 up to RMS_NORM_MAX_WARPS."""
    return min(RMS_NORM_MAX_WARPS, max(1, block // RMS_NORM_ELEMENTS_PER_WARP))


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """x, residual: [rows, n] -> (RMSNorm(x + residual) * weight, x + residual). The sum OVERWRITES `residual` in
    place (it becomes the next residual stream): pass a tensor that nothing else still needs."""
    rows, n = x.shape
    out = x.new_empty(rows, n)
    block = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(rows,)](
        x,
        residual,
        out,
        weight,
        x.stride(0),
        residual.stride(0),
        n,
        eps,
        BLOCK=block,
        num_warps=rms_norm_num_warps(block),
    )
    return out, residual


def qk_norm_rope_store_kv(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    positions: Tensor,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    q_weight: Tensor | None = None,
    k_weight: Tensor | None = None,
    eps: float = 0.0,
) -> Tensor:
    """In place: q [tokens, q_heads, head_dim] and k [tokens, k_heads, head_dim] get, per head, RMSNorm with
    q_weight / k_weight (Qwen3; skipped when None), then RoPE at their positions (cos, sin: [max_pos, head_dim/2]);
    then each token's K and V [tokens, k_heads, head_dim] go into its slot of k_cache, v_cache ([num_blocks,
    block_size, k_heads, head_dim], cast to their dtype, fp8 too), PAD_SLOT tokens skipped. Returns q. One kernel:
    the K/V store rides with the rotation, which already holds K, instead of a launch of its own per layer."""
    tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    _qk_norm_rope_store_kernel[(tokens,)](
        q,
        k,
        v,
        positions,
        cos,
        sin,
        q_weight,  # None without the norm: Triton compiles the kernel without it (a constant None)
        k_weight,
        k_cache,
        v_cache,
        slot_mapping,
        *q.stride()[:2],  # its token and head strides (a head's elements are adjacent)
        *k.stride()[:2],
        *v.stride()[:2],
        *k_cache.stride()[:3],  # block, slot, head (head_dim is contiguous)
        num_q_heads,
        num_k_heads,
        eps,
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        K_HEADS_PAD=triton.next_power_of_2(num_k_heads),
        HALF=head_dim // 2,
        BLOCK_SIZE=k_cache.shape[1],
        PAD=PAD_SLOT,
    )
    return q


def silu_and_mul(x: Tensor) -> Tensor:
    """x: [rows, 2n] = [gate | up] -> silu(gate) * up, [rows, n]."""
    rows, n = x.shape[0], x.shape[1] // 2
    out = x.new_empty(rows, n)
    block = min(SILU_BLOCK, triton.next_power_of_2(n))
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](x, out, x.stride(0), n, BLOCK=block)
    return out


def gumbel_argmax(logits: Tensor, temperatures: list[float], seeds: list[int]) -> Tensor:
    """logits: [rows, vocab] -> [rows] int64 token ids, one draw per row from softmax(logits / T)."""
    num_rows, vocab_size = logits.shape
    # one program per (row, chunk of GUMBEL_TILE entries): the grid is the shape of the per-chunk results
    chunk_best = logits.new_empty(num_rows, triton.cdiv(vocab_size, GUMBEL_TILE), dtype=torch.float32)
    chunk_id = torch.empty_like(chunk_best, dtype=torch.int64)
    _gumbel_argmax_kernel[chunk_best.shape](
        logits,
        logits.stride(0),
        to_device(temperatures, torch.float32, logits.device),
        to_device(seeds, torch.int64, logits.device),
        chunk_best,
        chunk_id,
        vocab_size,
        TILE=GUMBEL_TILE,  # and Triton's default of 4 warps
    )
    best_chunk = chunk_best.argmax(-1, keepdim=True)  # the second pass: the first of equal maxima, as in a chunk
    return chunk_id.gather(-1, best_chunk)[:, 0]
