"""The quantized projections' matmuls, each beside its PyTorch reference.

4- and 8-bit integer weights (AWQ, GPTQ, compressed-tensors' pack-quantized): one Triton kernel for every row count,
prefill and decode, y [rows, out] = x [rows, in] @ W [in, out], that reads W packed and dequantizes each tile
as it loads it: the weights cross the memory bus at 4 (or 8) bits each, and are multiplied in the activations' dtype.
Every format is loaded into one layout (GPTQ's), which the kernel reads:
  qweight [ceil(in / PACK), out] int32: PACK = 32 / bits values of one column in each int32, input feature
          i x PACK + j in bits [j x bits, (j + 1) x bits) of row i (unsigned: 0 ... 2^bits - 1);
  scales, zeros [groups, out] in the model's dtype: each group's scale and zero point per output feature;
  g_idx [in] int32: each input feature's group (i // group_size, or any order: GPTQ's desc_act, "act-order"),
so that W[i, n] = (q[i, n] - zeros[g_idx[i], n]) x scales[g_idx[i], n]. Looking each row's group up (rather than
assuming i // group_size) is what serves act-order checkpoints without reordering anything.

FP8 weights (compressed-tensors' float-quantized, and quantization="fp8"): float8 e4m3 [out, in] with a scale per
output feature, activations quantized to float8 per row (token) at run time, or by the checkpoint's static scale; the
product through torch._scaled_mm where the GPU has FP8 tensor cores (and cuBLASLt's row-wise scaling: sm_90+, bf16),
else the reference (the extension's weight_format chooses)."""

import torch
import torch.nn.functional as F
from torch import Tensor

from nanoserve.triton_shim import tl, triton

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448: the largest float8 e4m3 value
SCALE_EPS = torch.finfo(torch.float32).eps  # a row of zeros gets this scale, as compressed-tensors gives it


def tile_sizes(rows: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(rows, output features, input features) per program: for a decode step 16 rows (the smallest tile tl.dot
    takes) and narrow column tiles, so that its few rows still spread the weights over many programs; for prefill
    64 x 64, 64 deep (fp32: 64 x 32, 32 deep: FMA dots hold their operands in registers, and larger tiles spill)."""
    if rows <= 16:
        return 16, 32, 64
    if dtype == torch.float32:
        return 64, 32, 32
    return 64, 64, 64


@triton.jit
def _dequant_matmul_kernel(
    x_ptr,
    qweight_ptr,
    scales_ptr,
    zeros_ptr,
    g_idx_ptr,
    out_ptr,
    num_rows,
    in_features,
    out_features,
    stride_xm,
    stride_qk,
    stride_sg,
    stride_om,
    BITS: tl.constexpr,
    TILE_M: tl.constexpr,
    TILE_N: tl.constexpr,
    TILE_K: tl.constexpr,
):
    # program (row tile, column tile): out[rows, cols] = x[rows, :] @ W[:, cols], W dequantized tile by tile
    PACK: tl.constexpr = 32 // BITS
    m = tl.program_id(0) * TILE_M + tl.arange(0, TILE_M)
    n = tl.program_id(1) * TILE_N + tl.arange(0, TILE_N)
    in_m = m < num_rows
    in_n = n < out_features
    acc = tl.zeros((TILE_M, TILE_N), dtype=tl.float32)
    for k0 in range(0, in_features, TILE_K):
        k = k0 + tl.arange(0, TILE_K)
        in_k = k < in_features
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=in_m[:, None] & in_k[None, :], other=0.0)
        # each weight's int32 (PACK consecutive rows share one), shifted down to its BITS: [TILE_K, TILE_N]
        w_mask = in_k[:, None] & in_n[None, :]
        packed = tl.load(qweight_ptr + (k // PACK)[:, None] * stride_qk + n[None, :], mask=w_mask, other=0)
        q = (packed >> ((k % PACK) * BITS)[:, None]) & ((1 << BITS) - 1)
        # each row's group, and that group's scale and zero point for each column
        group = tl.load(g_idx_ptr + k, mask=in_k, other=0)
        at = group[:, None] * stride_sg + n[None, :]
        scale = tl.load(scales_ptr + at, mask=w_mask, other=0.0).to(tl.float32)
        zero = tl.load(zeros_ptr + at, mask=w_mask, other=0.0).to(tl.float32)
        w = ((q.to(tl.float32) - zero) * scale).to(x_ptr.dtype.element_ty)
        # "ieee": an fp32 model's products are not rounded to TF32
        acc += tl.dot(x, w, input_precision="ieee")
    tl.store(
        out_ptr + m[:, None] * stride_om + n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=in_m[:, None] & in_n[None, :],
    )


def dequant_matmul(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor, g_idx: Tensor, bits: int) -> Tensor:
    """x [rows, in] @ W [in, out] -> [rows, out] in x's dtype, W in the layout above, by the kernel."""
    rows, in_features = x.shape
    out_features = qweight.shape[1]
    assert x.stride(1) == 1 and qweight.is_contiguous() and scales.is_contiguous() and zeros.shape == scales.shape
    assert qweight.shape[0] == triton.cdiv(in_features, 32 // bits) and g_idx.shape == (in_features,)
    out = x.new_empty(rows, out_features)
    tile_m, tile_n, tile_k = tile_sizes(rows, x.dtype)
    grid = (triton.cdiv(rows, tile_m), triton.cdiv(out_features, tile_n))
    _dequant_matmul_kernel[grid](
        x,
        qweight,
        scales,
        zeros,
        g_idx,
        out,
        rows,
        in_features,
        out_features,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        out.stride(0),
        BITS=bits,
        TILE_M=tile_m,
        TILE_N=tile_n,
        TILE_K=tile_k,
    )
    return out


def unpack_columns(packed: Tensor, bits: int, order: list[int] | slice) -> Tensor:
    """int32 words [rows, words] -> their values [rows, words x 32 / bits], unsigned: word w's value number order[j]
    (the one in bits [order[j] x bits, ...)) is column w x (32 / bits) + j (slice(None): value j)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    values = (packed.to(torch.int32)[..., None] >> shifts) & (2**bits - 1)  # [rows, words, 32 / bits]
    return values[..., order].flatten(-2)


def dequantize(qweight: Tensor, scales: Tensor, zeros: Tensor, g_idx: Tensor, bits: int) -> Tensor:
    """W [in, out] in fp32 from the layout above: (q - zero) x scale of each row's group, as the kernel computes it."""
    q = unpack_columns(qweight.T, bits, slice(None)).T[: len(g_idx)]  # [in, out]
    return (q - zeros[g_idx].float()) * scales[g_idx].float()


def dequant_matmul_ref(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor, g_idx: Tensor, bits: int) -> Tensor:
    """The kernel's PyTorch reference: the whole weight dequantized (in x's dtype), then torch's matmul."""
    return x @ dequantize(qweight, scales, zeros, g_idx, bits).to(x.dtype)


# ---- FP8 ------------------------------------------------------------------------------------------------------------
def quantize_fp8(x: Tensor, scale: Tensor | None) -> tuple[Tensor, Tensor]:
    """x [rows, in] -> (x in float8 e4m3, its scale [rows, 1] fp32): per row from its largest magnitude (dynamic), or
    the checkpoint's static scale (a scalar). Computed as compressed-tensors computes it: x / scale, clamped, rounded to
    the nearest float8."""
    if scale is None:
        scale = x.abs().amax(-1, keepdim=True).float() / FP8_MAX
        scale = scale.masked_fill(scale == 0, SCALE_EPS)
    x8 = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return x8, scale.expand(len(x), 1).contiguous()


def fp8_matmul_ref(x: Tensor, weight: Tensor, weight_scale: Tensor, input_scale: Tensor | None) -> Tensor:
    """x [rows, in] @ (weight [out, in] float8 x weight_scale [out, 1])^T -> [rows, out] in x's dtype, x quantized to
    float8 first: both dequantized and multiplied in fp32 (what FP8 tensor cores compute, exactly rounded)."""
    x8, x_scale = quantize_fp8(x, input_scale)
    return F.linear(x8.float() * x_scale, weight.float() * weight_scale).to(x.dtype)


def fp8_matmul(x: Tensor, weight: Tensor, weight_scale: Tensor, input_scale: Tensor | None) -> Tensor:
    """The same on FP8 tensor cores: cuBLASLt's scaled matmul, a scale per row of x and per column of the output."""
    x8, x_scale = quantize_fp8(x, input_scale)
    return torch._scaled_mm(x8, weight.T, scale_a=x_scale, scale_b=weight_scale.reshape(1, -1), out_dtype=x.dtype)
