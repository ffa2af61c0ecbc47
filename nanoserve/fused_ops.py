"""A decoder layer's small elementwise work: residual add + RMSNorm, Qwen3's per-head QK-norm + RoPE with the K/V store
into the cache, and SiLU(gate) * up. Each is one Triton kernel instead of 5 to 20 PyTorch kernels, with its PyTorch
reference after it.

Why it matters: a decode step moves little data per kernel, so each kernel costs its fixed few microseconds on the GPU
even inside a CUDA graph; unfused, a Qwen3 layer launched about 70 kernels, fused it launches 11. Statistics are in
fp32, and RMSNorm and SiLU round to the model dtype where transformers does. RoPE is computed in fp32 and rounded once,
which is more accurate than transformers' bf16 products (they differ by one bf16 step in about a third of elements).
Kernels match their references to within rounding (summation order, the GPU's fast square root), not bit for bit."""

import torch
import torch.nn.functional as F
from torch import Tensor

from nanoserve.attention import PAD_SLOT, store_kv_ref
from nanoserve.triton_shim import tl, triton

SILU_BLOCK = 1024  # columns per program of the SiLU kernel
RMS_NORM_ELEMENTS_PER_WARP = 256  # 8 a thread: one 16-byte bf16 load each
RMS_NORM_MAX_WARPS = 16  # reached at 4k columns; wider rows give each thread more elements


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


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()  # the mean of squares in fp32, whatever the model dtype; rounded before the weight, as HF does
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm_ref(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    stream = x + residual  # the next residual stream
    return rms_norm_ref(stream, weight, eps), stream


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


def rope_ref(x: Tensor, positions: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [tokens, heads, head_dim] in the rotate-half layout; cos, sin: [max_pos, head_dim / 2] fp32."""
    cos, sin = cos[positions, None], sin[positions, None]  # [tokens, 1, head_dim / 2]: one row for all heads
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def qk_norm_rope_store_kv_ref(
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
    """qk_norm_rope_store_kv in PyTorch: q and k normed over each head (Qwen3's QK-norm, with weights) and rotated (k in
    place, as the kernel leaves it), then the store (attention.store_kv_ref). Returns the rotated q."""
    normed_k = k
    if q_weight is not None:
        q, normed_k = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
    k.copy_(rope_ref(normed_k, positions, cos, sin))
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    return rope_ref(q, positions, cos, sin)


def silu_and_mul(x: Tensor) -> Tensor:
    """x: [rows, 2n] = [gate | up] -> silu(gate) * up, [rows, n]."""
    rows, n = x.shape[0], x.shape[1] // 2
    out = x.new_empty(rows, n)
    block = min(SILU_BLOCK, triton.next_power_of_2(n))
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](x, out, x.stride(0), n, BLOCK=block)
    return out


def silu_and_mul_ref(x: Tensor) -> Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
