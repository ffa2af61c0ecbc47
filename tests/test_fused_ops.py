"""The fused layer kernels (nanoserve/fused_ops.py) against their PyTorch references beside them, and those
references against transformers' own modules and plain formulas, so the oracle is anchored too.

Fresh random inputs each run, odd sizes (widths and head counts that are not powers of two), q and k as the
strided views of one qkv buffer the model hands over. On CPU the kernels run in Triton's interpreter (fp32,
fp16); the gpu-marked cases run bf16. The reference-only tests are plain PyTorch and run every dtype anywhere.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' definition

import pytest
from transformers import LlamaConfig, Qwen3Config
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from nanoserve import attention, fused_ops, sampler
from nanoserve.kernels import get_kernels
from nanoserve.model import ModelArgs, Rotary

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # about one rounding of the output
CPU_DTYPES = [torch.float32, torch.float16]
DTYPES = CPU_DTYPES + [
    pytest.param(
        torch.bfloat16, marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
    )
]
ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]  # for the PyTorch-only reference checks


@pytest.fixture(autouse=True)
def fresh_seed():
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"torch.manual_seed({seed})")


def randint(low, high):
    return int(torch.randint(low, high + 1, ()))


def assert_close(out, ref, dtype, what):
    """Within about a rounding step; in fp16 also bit-equal almost everywhere (all but 2% of the elements, or
    all but two in a small tensor), which catches a kernel that skips one of the roundings the reference does
    (that alone moves ~25% of elements by one step). A few differ by chance: a QK-norm whose fp32 mean square
    sums in another order may move a normed element by an ulp, and RoPE then carries it into both elements of
    its rotated pair, over 2% of a tensor of under 100 elements (a small draw's k or cached K)."""
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= ATOL[dtype] * max(1.0, ref.float().abs().max().item()), f"{what}: max abs err {err:.3g}"
    if dtype == torch.float16:
        differ = int((out != ref).sum())
        assert differ <= max(2, 0.02 * out.numel()), (
            f"{what}: {differ} of {out.numel()} elements not bit-equal to the reference"
        )


def make_args(head_dim, num_heads, num_kv_heads, qk_norm):
    return ModelArgs(
        vocab_size=16,
        hidden_size=64,
        intermediate_size=64,
        num_layers=1,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=EPS,
        max_position=512,
        rope_theta=10000.0,
        rope_scaling=None,
        tie_word_embeddings=False,
        qkv_bias=False,
        o_bias=False,
        qk_norm=qk_norm,
    )


def test_backends_pair_each_kernel_with_its_reference():
    """Guards against get_kernels wiring a kernel into the wrong slot, or a Triton kernel into the torch backend
    (the tests below check kernel against reference function by function; the model sees only these tables)."""
    triton, torch_ = get_kernels("triton"), get_kernels("torch")
    assert (triton.name, torch_.name) == ("triton", "torch")
    pairs = {
        "add_rms_norm": (fused_ops.add_rms_norm, fused_ops.add_rms_norm_ref),
        "qk_norm_rope_store_kv": (fused_ops.qk_norm_rope_store_kv, fused_ops.qk_norm_rope_store_kv_ref),
        "silu_and_mul": (fused_ops.silu_and_mul, fused_ops.silu_and_mul_ref),
        "paged_attention": (attention.paged_attention, attention.paged_attention_ref),
        "gumbel_argmax": (sampler.gumbel_argmax, sampler.gumbel_argmax_ref),
    }
    for name, (kernel, reference) in pairs.items():
        assert getattr(triton, name) is kernel and getattr(torch_, name) is reference, name


# ---- the Triton kernels against the references -----------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("first_layer", [False, True])
def test_add_rms_norm_writes_the_stream_back(dtype, first_layer):
    """Guards against a wrong norm, a residual add that is lost or not written back in place, padded columns, and
    mixing up x's row stride with the residual's (x is a view into a wider buffer, as a sliced projection is).
    first_layer: the stream starts as zeros, so it must become x exactly."""
    rows, width = randint(1, 9), randint(40, 200)
    weight = torch.randn(width, device=DEVICE).to(dtype)
    wide = torch.randn(rows, width + randint(1, 30), device=DEVICE).to(dtype)
    x = wide[:, :width]
    residual = (
        torch.zeros(rows, width, device=DEVICE, dtype=dtype)
        if first_layer
        else torch.randn(rows, width, device=DEVICE).to(dtype)
    )
    wide_before, residual_before = wide.clone(), residual.clone()
    ref_out, ref_stream = fused_ops.add_rms_norm_ref(x.clone(), residual.clone(), weight, EPS)
    out, stream = fused_ops.add_rms_norm(x, residual, weight, EPS)
    assert stream is residual, "the stream is the caller's residual tensor, overwritten in place"
    assert torch.equal(residual, ref_stream), "residual stream: x + residual, rounded once to the model dtype"
    assert torch.equal(ref_stream, x + residual_before)
    if first_layer:
        assert torch.equal(residual, x)
    assert torch.equal(wide, wide_before), "x (and the columns beside it) must not be written"
    assert_close(out, ref_out, dtype, "normed")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "head_dim,num_heads,num_kv_heads,qk_norm", [(16, 3, 1, True), (32, 4, 2, False), (64, 6, 6, True)]
)
def test_qk_norm_rope_store_kv_on_qkv_views(dtype, head_dim, num_heads, num_kv_heads, qk_norm):
    """Guards against rotating the wrong halves or positions, norming across heads, touching v, and a store that
    writes the unrotated K, the wrong slot, another head, or a padded token's slot: q and k (views into one
    projection, as the model's are) rotated in place as the reference rotates them, and the caches written as the
    reference writes them, slot for slot."""
    rotary = Rotary(make_args(head_dim, num_heads, num_kv_heads, qk_norm)).to(DEVICE)
    tokens, block_size, num_blocks = randint(2, 7), 16, 3  # 2+: at least one token is not padding
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, device=DEVICE).to(dtype)
    positions = torch.randint(0, rotary.cos.shape[0], (tokens,), device=DEVICE, dtype=torch.int32)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens].int()
    slots[::3] = attention.PAD_SLOT  # the first token, and every third, is padding: its slot stays as it was
    weights = (
        (torch.randn(head_dim, device=DEVICE).to(dtype), torch.randn(head_dim, device=DEVICE).to(dtype), EPS)
        if qk_norm
        else ()
    )
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE).to(dtype)

    def split(t):
        q, k, v = t.split([q_size, kv_size, kv_size], dim=-1)
        return (
            q.view(tokens, num_heads, head_dim),
            k.view(tokens, num_kv_heads, head_dim),
            v.view(k.shape[0], -1, head_dim),
        )

    ref_cache = cache.clone()
    q, k, v = split(qkv.clone())
    ref_q = fused_ops.qk_norm_rope_store_kv_ref(q, k, v, positions, rotary.cos, rotary.sin, *ref_cache, slots, *weights)
    ref_k = k  # rotated in place by the reference too

    fused = qkv.clone()
    q, k, v = split(fused)
    out_q = fused_ops.qk_norm_rope_store_kv(q, k, v, positions, rotary.cos, rotary.sin, *cache, slots, *weights)
    assert out_q is q
    assert_close(q, ref_q, dtype, "q")  # q and k: the views into `fused`, so this checks the in-place write
    assert_close(k, ref_k, dtype, "k")
    assert torch.equal(v, split(qkv)[2])
    padded = slots == attention.PAD_SLOT
    written = slots[~padded].long()
    assert_close(cache[0].flatten(0, 1)[written], ref_cache[0].flatten(0, 1)[written], dtype, "K in the cache")
    assert torch.equal(cache[1].flatten(0, 1)[written], v[~padded]), "V in the cache: as given"
    others = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    others[written] = False
    assert torch.equal(cache.flatten(1, 2)[:, others], ref_cache.flatten(1, 2)[:, others]), "no other slot written"


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    """Guards against swapped gate and up halves and unwritten columns past a program's block."""
    rows, width = randint(1, 5), fused_ops.SILU_BLOCK + randint(1, 300)  # two column blocks, the last ragged
    x = torch.randn(rows, 2 * width, device=DEVICE).to(dtype)
    assert_close(fused_ops.silu_and_mul(x), fused_ops.silu_and_mul_ref(x), dtype, "silu * up")


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
            assert torch.equal(fused_ops.rms_norm_ref(x, weight, EPS), module(x)), type(module).__name__
            normed, stream = fused_ops.add_rms_norm_ref(x, residual, weight, EPS)
            assert torch.equal(stream, x + residual) and torch.equal(normed, module(x + residual))
    x64 = x.double()
    plain = weight.double() * x64 / (x64.pow(2).mean(-1, keepdim=True) + EPS).sqrt()
    err = (fused_ops.rms_norm_ref(x, weight, EPS).double() - plain).abs().max().item()
    assert err <= 2 * ATOL[dtype] * max(1.0, plain.abs().max().item()), f"vs float64: {err:.3g}"


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_silu_and_mul_ref_matches_transformers(dtype):
    """silu_and_mul_ref is transformers' MLP activation (ACT2FN['silu'](gate) * up) on [gate | up], bit for bit,
    and silu(g) * u = g / (1 + exp(-g)) * u in float64."""
    rows, width = randint(1, 5), randint(3, 300)
    x = torch.randn(rows, 2 * width).to(dtype)
    gate, up = x[:, :width], x[:, width:]
    assert torch.equal(fused_ops.silu_and_mul_ref(x), ACT2FN["silu"](gate) * up)
    g, u = gate.double(), up.double()
    err = (fused_ops.silu_and_mul_ref(x).double() - g / (1 + torch.exp(-g)) * u).abs().max().item()
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
    got_q = fused_ops.qk_norm_rope_store_kv_ref(q, got_k, got_k, positions, cos, sin, cache, cache, no_slots, *weights)
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
        assert torch.equal(fused_ops.rope_ref(q, positions, cos, sin), got_q)
    # and the plain formula: each pair (x_i, x_{i + half}) turns by the angle pos * inv_freq_i
    angle = positions.double()[:, None] * torch.atan2(hf_sin[1, : head_dim // 2], hf_cos[1, : head_dim // 2]).double()
    x = fused_ops.rms_norm_ref(q, weights[0], EPS) if qk_norm else q
    x1, x2 = x.double().chunk(2, dim=-1)
    c, s = angle.cos()[:, None], angle.sin()[:, None]
    plain = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    torch.testing.assert_close(got_q.double(), plain, atol=2e-3, rtol=0)  # fp32 angles of up to ~500 rad
