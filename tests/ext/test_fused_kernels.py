"""The fused Triton kernels (nanoserve/ext/fused_kernels.py) against the PyTorch references they replace
(nanoserve/layer_ops.py, sampler.gumbel_argmax_ref).

Fresh random inputs each run, odd sizes (widths and head counts that are not powers of two), q and k as the
strided views of one qkv buffer the model hands over. On CPU the kernels run in Triton's interpreter (fp32,
fp16); the gpu-marked cases run bf16.
"""

import os

import pytest
import torch
from conftest import extension_or_skip
from test_sampler import assert_draws_follow, counts_of, tokens_of

from nanoserve import attention, layer_ops
from nanoserve.model import ModelArgs, Rotary
from nanoserve.sampler import SamplingParams

fused_kernels = extension_or_skip("fused_kernels")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # about one rounding of the output
CPU_DTYPES = [torch.float32, torch.float16]
DTYPES = CPU_DTYPES + [
    pytest.param(
        torch.bfloat16, marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
    )
]
NONE = frozenset()


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
    ref_out, ref_stream = layer_ops.add_rms_norm_ref(x.clone(), residual.clone(), weight, EPS)
    out, stream = fused_kernels.add_rms_norm(x, residual, weight, EPS)
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
    ref_q = layer_ops.qk_norm_rope_store_kv_ref(q, k, v, positions, rotary.cos, rotary.sin, *ref_cache, slots, *weights)
    ref_k = k  # rotated in place by the reference too

    fused = qkv.clone()
    q, k, v = split(fused)
    out_q = fused_kernels.qk_norm_rope_store_kv(q, k, v, positions, rotary.cos, rotary.sin, *cache, slots, *weights)
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
    rows, width = randint(1, 5), fused_kernels.SILU_BLOCK + randint(1, 300)  # two column blocks, the last ragged
    x = torch.randn(rows, 2 * width, device=DEVICE).to(dtype)
    assert_close(fused_kernels.silu_and_mul(x), layer_ops.silu_and_mul_ref(x), dtype, "silu * up")


# ---- the sampler's draw: the Gumbel-max kernel ------------------------------------------------------------------
@pytest.fixture
def tile(monkeypatch):
    """A small vocabulary tile, so a small vocabulary spans several tiles (and the interpreter stays quick)."""
    monkeypatch.setattr(fused_kernels, "GUMBEL_TILE", 16)
    return 16


def test_kernel_keeps_the_best_tile(tile):
    """Guards against the running max across vocabulary tiles keeping the first or the last tile's winner."""
    logits = torch.full((3 * tile,), float("-inf"), device=DEVICE)
    hot = torch.tensor([5, tile + 3, 2 * tile + 6], device=DEVICE)  # one candidate per tile
    logits[hot] = torch.tensor([0.0, 4.0, 0.0], device=DEVICE)  # the middle one: probability 0.96
    counts = counts_of("triton", logits, 60, temperature=1.0)  # on the host
    hot = hot.cpu()  # indices on the tensor's device (on a GPU, CUDA indices into a CPU tensor fail)
    assert counts[hot].sum() == 60 and counts[hot[1]] > 48, counts[hot]  # expected 58; 12 misses: p ~ 1e-6


def test_seeded_draws_follow_softmax_across_many_seeds(monkeypatch):
    """Guards against Philox streams that are not independent uniforms across seeds and columns: four uniforms per
    call spread over the wrong columns (two columns sharing one, a lane never used) or the vocabulary's chunks
    drawing correlated noise. One seeded request per seed, 500 seeds, ten tokens over two chunks of eight: the
    tokens follow softmax(logits / T)."""
    monkeypatch.setattr(fused_kernels, "GUMBEL_TILE", 8)
    logits = (torch.randn(10) * 0.3).to(DEVICE)  # every p >= ~1/25: >= ~20 expected draws
    params = [SamplingParams(temperature=0.9, seed=seed) for seed in range(500)]
    tokens = tokens_of("triton", logits.repeat(len(params), 1), params, [5] * len(params))
    counts = torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1])
    assert_draws_follow(counts, (logits / 0.9).softmax(-1), "500 seeds")


def test_kernel_draw_does_not_depend_on_the_tile(monkeypatch):
    """Guards against noise tied to the kernel's tiling: column c's uniform is Philox counter c // 4, lane c % 4,
    whatever the chunk size, so a seeded request draws the same token when GUMBEL_TILE changes."""
    logits = torch.randn(8, 200, device=DEVICE) * 0.1
    params = [SamplingParams(temperature=1.0, seed=seed) for seed in range(8)]
    draws = []
    for tile in (16, 64, 256):
        monkeypatch.setattr(fused_kernels, "GUMBEL_TILE", tile)
        draws.append(tokens_of("triton", logits, params, [9] * 8))
    assert draws[0] == draws[1] == draws[2] and len(set(draws[0])) > 2
