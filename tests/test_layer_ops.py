"""The PyTorch references of a decoder layer's small ops (nanoserve/layer_ops.py) against transformers' own modules and
plain formulas, so the oracle that the fused Triton kernels (tests/ext/test_fused_kernels.py) are held to is anchored
too; and the kernel table that pairs each backend's functions. Plain PyTorch: every dtype, any machine.
"""

import os

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from nanoserve import attention, layer_ops, sampler
from nanoserve.ext import find
from nanoserve.kernels import get_kernels
from nanoserve.model import ModelArgs, Rotary

EPS = 1e-6
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # about one rounding of the output
ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def fresh_seed():
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"torch.manual_seed({seed})")


def randint(low, high):
    return int(torch.randint(low, high + 1, ()))


def test_backends_pair_each_kernel_with_its_reference():
    """Guards against get_kernels wiring a function into the wrong slot, or a Triton kernel into the torch backend:
    the torch backend is the references; the Triton backend is the core's Triton attention and, where the extension
    ext/fused_kernels.py is installed, its kernels (found by name), else the references again."""
    triton, torch_ = get_kernels("triton"), get_kernels("torch")
    assert (triton.name, torch_.name) == ("triton", "torch")
    references = {
        "add_rms_norm": layer_ops.add_rms_norm_ref,
        "qk_norm_rope_store_kv": layer_ops.qk_norm_rope_store_kv_ref,
        "silu_and_mul": layer_ops.silu_and_mul_ref,
        "paged_attention": attention.paged_attention_ref,
        "gumbel_argmax": sampler.gumbel_argmax_ref,
    }
    fused = find("fused_kernels")
    fused_kernels = fused.kernels() if fused is not None else {}
    assert set(fused_kernels) <= set(references) - {"paged_attention"}
    for name, reference in references.items():
        assert getattr(torch_, name) is reference, name
        expected = fused_kernels.get(name, reference)
        if name == "paged_attention":
            expected = attention.paged_attention
        assert getattr(triton, name) is expected, name


# ---- the references against transformers and plain formulas (PyTorch only: every dtype, any machine) ---------
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_rms_norm_refs_match_transformers(dtype):
    """rms_norm_ref and add_rms_norm_ref round exactly as transformers' LlamaRMSNorm and Qwen3RMSNorm do (the
    kernel tests' bit-equality share rests on that), and agree with RMSNorm written out in float64."""
    rows, width = randint(1, 9), randint(40, 200)
    x, residual = torch.randn(rows, width).to(dtype), torch.randn(rows, width).to(dtype)
    weight = torch.randn(width).to(dtype)
    for module in (LlamaRMSNorm(width, eps=EPS), Qwen3RMSNorm(width, eps=EPS)):
        module = module.to(dtype)
        module.weight.data.copy_(weight)
        with torch.no_grad():
            assert torch.equal(layer_ops.rms_norm_ref(x, weight, EPS), module(x)), type(module).__name__
            normed, stream = layer_ops.add_rms_norm_ref(x, residual, weight, EPS)
            assert torch.equal(stream, x + residual) and torch.equal(normed, module(x + residual))
    x64 = x.double()
    plain = weight.double() * x64 / (x64.pow(2).mean(-1, keepdim=True) + EPS).sqrt()
    err = (layer_ops.rms_norm_ref(x, weight, EPS).double() - plain).abs().max().item()
    assert err <= 2 * ATOL[dtype] * max(1.0, plain.abs().max().item()), f"vs float64: {err:.3g}"


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_silu_and_mul_ref_matches_transformers(dtype):
    """silu_and_mul_ref is transformers' MLP activation (ACT2FN['silu'](gate) * up) on [gate | up], bit for bit,
    and silu(g) * u = g / (1 + exp(-g)) * u in float64."""
    rows, width = randint(1, 5), randint(3, 300)
    x = torch.randn(rows, 2 * width).to(dtype)
    gate, up = x[:, :width], x[:, width:]
    assert torch.equal(layer_ops.silu_and_mul_ref(x), ACT2FN["silu"](gate) * up)
    g, u = gate.double(), up.double()
    err = (layer_ops.silu_and_mul_ref(x).double() - g / (1 + torch.exp(-g)) * u).abs().max().item()
    assert err <= 2 * ATOL[dtype] * max(1.0, (g * u).abs().max().item()), f"vs float64: {err:.3g}"


ROPE_CONFIGS = {
    "default": {"rope_theta": 10000.0, "rope_type": "default"},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


@pytest.mark.parametrize("rope", ROPE_CONFIGS)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_refs_match_transformers(rope, qk_norm):
    """model.Rotary's cos/sin tables equal transformers' LlamaRotaryEmbedding (default and Llama 3 scaling), and
    qk_norm_rope_store_kv_ref's rotation on them (q returned, k in place; every slot PAD_SLOT, nothing stored) equals
    Qwen3's per-head q_norm/k_norm followed by apply_rotary_pos_emb, or that alone without the norm (fp32, where
    transformers rounds nothing in between)."""
    head_dim, num_heads, num_kv_heads, max_pos = 32, 6, 2, 512
    cfg_class = Qwen3Config if qk_norm else LlamaConfig
    cfg = cfg_class(
        vocab_size=16,
        hidden_size=num_heads * head_dim,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rms_norm_eps=EPS,
        rope_parameters=dict(ROPE_CONFIGS[rope]),
    )
    rotary = Rotary(ModelArgs.from_hf(cfg))
    hf_rotary = LlamaRotaryEmbedding(cfg)
    all_pos = torch.arange(max_pos)
    hf_cos, hf_sin = hf_rotary(torch.zeros(1, dtype=torch.float32), all_pos[None])  # [1, max_pos, head_dim]
    hf_cos, hf_sin = hf_cos[0], hf_sin[0]
    assert torch.equal(hf_cos[:, : head_dim // 2], hf_cos[:, head_dim // 2 :])  # HF repeats the half table
    torch.testing.assert_close(rotary.cos, hf_cos[:, : head_dim // 2], atol=1e-4, rtol=0)  # angles up to ~500 rad
    torch.testing.assert_close(rotary.sin, hf_sin[:, : head_dim // 2], atol=1e-4, rtol=0)

    tokens = randint(1, 9)
    positions = torch.randint(0, max_pos, (tokens,), dtype=torch.int32)  # int32, as the model passes them
    q, k = torch.randn(tokens, num_heads, head_dim), torch.randn(tokens, num_kv_heads, head_dim)
    weights = (torch.randn(head_dim), torch.randn(head_dim), EPS) if qk_norm else ()
    cos, sin = hf_cos[:, : head_dim // 2].contiguous(), hf_sin[:, : head_dim // 2].contiguous()  # the same tables
    got_k = k.clone()
    no_slots = torch.full((tokens,), attention.PAD_SLOT, dtype=torch.int32)
    cache = torch.zeros(1, 1, num_kv_heads, head_dim)
    got_q = layer_ops.qk_norm_rope_store_kv_ref(q, got_k, got_k, positions, cos, sin, cache, cache, no_slots, *weights)
    assert not cache.any()
    want_q, want_k = q, k
    if qk_norm:
        q_norm, k_norm = Qwen3RMSNorm(head_dim, eps=EPS), Qwen3RMSNorm(head_dim, eps=EPS)
        q_norm.weight.data.copy_(weights[0])
        k_norm.weight.data.copy_(weights[1])
        with torch.no_grad():
            want_q, want_k = q_norm(q), k_norm(k)  # per head: [tokens, heads, head_dim] normed over head_dim
    # [tokens, heads, head_dim] with cos [tokens, head_dim]: unsqueeze_dim=1 broadcasts over the heads
    want_q, want_k = apply_rotary_pos_emb(want_q, want_k, hf_cos[positions.long()], hf_sin[positions.long()])
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)
    if not qk_norm:
        assert torch.equal(layer_ops.rope_ref(q, positions, cos, sin), got_q)
    # and the plain formula: each pair (x_i, x_{i + half}) turns by the angle pos * inv_freq_i
    angle = positions.double()[:, None] * torch.atan2(hf_sin[1, : head_dim // 2], hf_cos[1, : head_dim // 2]).double()
    x = layer_ops.rms_norm_ref(q, weights[0], EPS) if qk_norm else q
    x1, x2 = x.double().chunk(2, dim=-1)
    c, s = angle.cos()[:, None], angle.sin()[:, None]
    plain = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    torch.testing.assert_close(got_q.double(), plain, atol=2e-3, rtol=0)  # fp32 angles of up to ~500 rad
