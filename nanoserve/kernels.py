"""Kernels are chosen once, when the model is built: two backends with the same functions and meaning, the Triton
kernels (GPU; CPU tests run them in Triton's interpreter) or their PyTorch references (any machine), each reference
beside its kernel (attention.py, fused_ops.py, sampler.py). The model and the sampler never branch on the choice.
triton has Linux wheels only, and this is the one place that imports it: without it the kernel files still load (their
kernels stay plain, never-called functions), so the PyTorch references run on macOS and Windows."""

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:
    triton = SimpleNamespace(jit=lambda fn: fn)  # @triton.jit leaves the function as it is
    tl = SimpleNamespace(constexpr=None)  # kernel signatures annotate with tl.constexpr
    HAVE_TRITON = False


@dataclass(frozen=True)
class Kernels:
    name: str
    add_rms_norm: Callable  # (x, residual, weight, eps) -> (RMSNorm(x + residual) * weight, x + residual)
    qk_norm_rope: Callable  # (q, k, positions, cos, sin, q_weight, k_weight, eps) -> (q, k), rotated
    silu_and_mul: Callable  # [rows, 2n] = [gate | up] -> silu(gate) * up, [rows, n]
    store_kv: Callable  # (k, v, k_cache, v_cache, slot_mapping): this step's K/V into their slots
    paged_attention: Callable  # (q, k_cache, v_cache, meta, scale) -> out: through the block tables
    gumbel_argmax: Callable  # (logits, temperatures, seeds) -> tokens: a draw from softmax(logits / T)


def get_kernels(name: str) -> Kernels:
    from nanoserve import attention, fused_ops, sampler

    if name == "triton":
        return Kernels(
            "triton",
            fused_ops.add_rms_norm,
            fused_ops.qk_norm_rope,
            fused_ops.silu_and_mul,
            attention.store_kv,
            attention.paged_attention,
            sampler.gumbel_argmax,
        )
    return Kernels(
        "torch",
        fused_ops.add_rms_norm_ref,
        fused_ops.qk_norm_rope_ref,
        fused_ops.silu_and_mul_ref,
        attention.store_kv_ref,
        attention.paged_attention_ref,
        sampler.gumbel_argmax_ref,
    )
