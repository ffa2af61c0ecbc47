"""The backend table: kernels are chosen once, when the model is built, and the model and the sampler never branch on
the choice. The PyTorch backend ("torch") runs anywhere: the references in attention.py, layer_ops.py and sampler.py.
The Triton backend ("triton": a GPU; CPU tests run it in Triton's interpreter) is the core's own paged attention
(attention.py), and, where the extension ext/fused_kernels.py is installed (it is found by name, as the core finds any
extension it consults unasked), one fused Triton kernel for each of the others. The optional triton import itself
lives in triton_shim.py, which the kernel files import; this table imports them, never the other way round."""

from collections.abc import Callable
from dataclasses import dataclass, replace

from nanoserve import attention, layer_ops, sampler
from nanoserve.ext import find


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


REFERENCES = Kernels(
    "torch",
    layer_ops.add_rms_norm_ref,
    layer_ops.qk_norm_rope_store_kv_ref,
    layer_ops.silu_and_mul_ref,
    attention.paged_attention_ref,
    sampler.gumbel_argmax_ref,
)


def get_kernels(name: str) -> Kernels:
    """The Triton backend for name "triton", the PyTorch references for any other name."""
    if name != "triton":
        return REFERENCES
    kernels = replace(REFERENCES, name="triton", paged_attention=attention.paged_attention)
    fused = find("fused_kernels")
    if fused is not None:
        kernels = replace(kernels, **fused.kernels())
    return kernels
