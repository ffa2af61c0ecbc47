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
    qk_norm_rope: Callable  # (q, k, positions, cos, sin, q_weight, k_weight, eps) -> (q, k), rotated
    silu_and_mul: Callable  # [rows, 2n] = [gate | up] -> silu(gate) * up, [rows, n]
    store_kv: Callable  # (k, v, k_cache, v_cache, slot_mapping): this step's K/V into their slots (cast: fp8 too)
    paged_attention: Callable  # (q, k_cache, v_cache, meta, scale) -> out: through the block tables
    gumbel_argmax: Callable  # (logits, temperatures, seeds) -> tokens: a draw from softmax(logits / T)


def get_kernels(name: str) -> Kernels:
    """The Triton kernels for name "triton"; the PyTorch references for any other name."""
    if name == "triton":
        return Kernels(
            name="triton",
            add_rms_norm=fused_ops.add_rms_norm,
            qk_norm_rope=fused_ops.qk_norm_rope,
            silu_and_mul=fused_ops.silu_and_mul,
            store_kv=attention.store_kv,
            paged_attention=attention.paged_attention,
            gumbel_argmax=sampler.gumbel_argmax,
        )
    return Kernels(
        name="torch",
        add_rms_norm=fused_ops.add_rms_norm_ref,
        qk_norm_rope=fused_ops.qk_norm_rope_ref,
        silu_and_mul=fused_ops.silu_and_mul_ref,
        store_kv=attention.store_kv_ref,
        paged_attention=attention.paged_attention_ref,
        gumbel_argmax=sampler.gumbel_argmax_ref,
    )
