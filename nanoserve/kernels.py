"""The backend table: kernels are chosen once, when the model is built. Two backends have the same functions and
meaning: the Triton kernels (GPU; CPU tests run them in Triton's interpreter) or their PyTorch references (any
machine), each reference beside its kernel in attention.py, fused_ops.py and sampler.py. The model and the sampler
never branch on the choice. The optional triton import itself lives in triton_shim.py, which the kernel files import;
this table imports them, never the other way round."""

from collections.abc import Callable
from dataclasses import dataclass

from nanoserve import attention, fused_ops, sampler


@dataclass(frozen=True)
class Kernels:
    name: str
    add_rms_norm: Callable  # (x, residual, weight, eps) -> (RMSNorm(x + residual) * weight, x + residual)
    # (q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, q_weight, k_weight, eps) -> q: q and k normed
    # (Qwen3) and rotated, k in place (the kernel rotates q in place too and returns it; the reference returns a new
    # q), then this step's K/V into their slots (cast: fp8 too)
    qk_norm_rope_store_kv: Callable
    silu_and_mul: Callable  # [rows, 2n] = [gate | up] -> silu(gate) * up, [rows, n]
    paged_attention: Callable  # (q, k_cache, v_cache, meta, scale) -> out: through the block tables
    gumbel_argmax: Callable  # (logits, temperatures, seeds) -> tokens: a draw from softmax(logits / T)


def get_kernels(name: str) -> Kernels:
    """The Triton kernels for name "triton"; the PyTorch references for any other name. Each argument is the function
    of the field with its name, in the fields' order."""
    if name == "triton":
        return Kernels(
            "triton",
            fused_ops.add_rms_norm,
            fused_ops.qk_norm_rope_store_kv,
            fused_ops.silu_and_mul,
            attention.paged_attention,
            sampler.gumbel_argmax,
        )
    return Kernels(
        "torch",
        fused_ops.add_rms_norm_ref,
        fused_ops.qk_norm_rope_store_kv_ref,
        fused_ops.silu_and_mul_ref,
        attention.paged_attention_ref,
        sampler.gumbel_argmax_ref,
    )
