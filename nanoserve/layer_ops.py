"""A decoder layer's small elementwise work, in PyTorch: residual add + RMSNorm, Qwen3's per-head QK-norm + RoPE with
the K/V store into the cache, and SiLU(gate) * up. These are what the model calls through its kernel table (kernels.py)
on any machine; with kernels="triton" the extension ext/fused_kernels.py replaces each by one Triton kernel of the same
meaning (kernel fusion: a decode step's many small launches), and the tests hold those kernels to these functions.

Statistics are in fp32, and RMSNorm and SiLU round to the model dtype where transformers does. RoPE is computed in fp32
and rounded once, which is more accurate than transformers' bf16 products (they differ by one bf16 step in about a
third of elements)."""

import torch
import torch.nn.functional as F
from torch import Tensor

from nanoserve.attention import store_kv_ref


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()  # the mean of squares in fp32, whatever the model dtype; rounded before the weight, as HF does
    inv_rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (xf * inv_rms).to(x.dtype)


def add_rms_norm_ref(
    x: Tensor,
    residual: Tensor,
    weight: Tensor,
    eps: float,
) -> tuple[Tensor, Tensor]:
    stream = x + residual  # the next residual stream
    return rms_norm_ref(stream, weight, eps), stream


def rope_ref(x: Tensor, positions: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [tokens, heads, head_dim] in the rotate-half layout; cos, sin: [max_pos, head_dim / 2] fp32."""
    cos, sin = cos[positions, None], sin[positions, None]  # [tokens, 1, head_dim / 2]: one row for all heads
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)


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


def silu_and_mul_ref(x: Tensor) -> Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
