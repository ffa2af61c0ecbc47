"""The fused layer kernels (nanoserve/fused_ops.py) against the PyTorch code in model.py they replace.

Fresh random inputs each run, odd sizes (widths and head counts that are not powers of two), q and k as the
strided views of one qkv buffer the model hands over. On CPU the kernels run in Triton's interpreter (fp32,
fp16); the gpu-marked cases run bf16.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' definition

import pytest
import torch.nn.functional as F

from nanoserve import fused_ops
from nanoserve.model import ModelArgs, RMSNorm, Rotary

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # about one rounding of the output
CPU_DTYPES = [torch.float32, torch.float16]
DTYPES = CPU_DTYPES + [pytest.param(torch.bfloat16, marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.fixture(autouse=True)
def fresh_seed():
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"torch.manual_seed({seed})")


def randint(low, high):
    return int(torch.randint(low, high + 1, ()))


def assert_close(out, ref, dtype, what):
    """Within about a rounding step; in fp16 also bit-equal almost everywhere, which catches a kernel that
    skips one of the roundings the PyTorch code does (that alone moves ~25% of elements by one step)."""
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= ATOL[dtype] * max(1.0, ref.float().abs().max().item()), f"{what}: max abs err {err:.3g}"
    if dtype == torch.float16:
        equal = (out == ref).float().mean().item()
        assert equal >= 0.98, f"{what}: only {equal:.1%} of elements bit-equal to the reference"


def make_args(head_dim, num_heads, num_kv_heads, qk_norm):
    return ModelArgs(vocab_size=16, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, rms_norm_eps=1e-6, max_position=512,
                     rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=False, qkv_bias=False,
                     o_bias=False, qk_norm=qk_norm)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_with_fused_residual_add(dtype, with_residual):
    """Guards against a wrong norm, a residual add that is lost or not written back, and padded columns."""
    rows, width = randint(1, 9), randint(40, 200)
    torch_norm = RMSNorm(width, 1e-6).to(DEVICE, dtype)
    torch_norm.weight.data.normal_()
    triton_norm = RMSNorm(width, 1e-6, use_triton=True).to(DEVICE, dtype)
    triton_norm.weight.data.copy_(torch_norm.weight)
    x = torch.randn(rows, width, device=DEVICE).to(dtype)
    residual = torch.randn(rows, width, device=DEVICE).to(dtype) if with_residual else None
    ref_out, ref_stream = torch_norm(x, residual)
    out, stream = triton_norm(x, residual.clone() if with_residual else None)
    assert_close(out, ref_out, dtype, "normed")
    assert torch.equal(stream, ref_stream), "residual stream: x + residual, rounded once to the model dtype"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads,qk_norm", [(16, 3, 1, True), (32, 4, 2, False),
                                                                      (64, 6, 6, True)])
def test_qk_norm_rope_in_place_on_qkv_views(dtype, head_dim, num_heads, num_kv_heads, qk_norm):
    """Guards against rotating the wrong halves or positions, norming across heads, or touching v."""
    args = make_args(head_dim, num_heads, num_kv_heads, qk_norm)
    rotary = Rotary(args).to(DEVICE)
    tokens = randint(1, 7)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, device=DEVICE).to(dtype)
    positions = torch.randint(0, args.max_position, (tokens,), device=DEVICE, dtype=torch.int32)
    q_norm, k_norm = RMSNorm(head_dim, 1e-6).to(DEVICE, dtype), RMSNorm(head_dim, 1e-6).to(DEVICE, dtype)
    q_norm.weight.data.normal_()
    k_norm.weight.data.normal_()

    def split(t):
        q, k, v = t.split([q_size, kv_size, kv_size], dim=-1)
        return q.view(tokens, num_heads, head_dim), k.view(tokens, num_kv_heads, head_dim), v
    q, k, v = split(qkv.clone())
    if qk_norm:
        q, k = q_norm(q)[0], k_norm(k)[0]
    ref_q, ref_k = rotary(positions.long(), q), rotary(positions.long(), k)

    fused = qkv.clone()
    q, k, v = split(fused)
    weights = (q_norm.weight, k_norm.weight, 1e-6) if qk_norm else ()
    fused_ops.qk_norm_rope(q, k, positions, rotary.cos, rotary.sin, *weights)
    assert_close(q, ref_q, dtype, "q")
    assert_close(k, ref_k, dtype, "k")
    assert torch.equal(v, split(qkv)[2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    """Guards against swapped gate and up halves and unwritten columns past a program's block."""
    rows, width = randint(1, 5), fused_ops.SILU_BLOCK + randint(1, 300)  # two column blocks, the last ragged
    x = torch.randn(rows, 2 * width, device=DEVICE).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    assert_close(fused_ops.silu_and_mul(x), F.silu(gate) * up, dtype, "silu * up")
