"""The few-row weight read (nanoserve/ext/gemv.py): the split-K GEMV kernel against its PyTorch reference and against a
plain fp32 matmul on freshly drawn shapes (in Triton's interpreter on a CPU), its arrival counters back at zero after
every launch; the plan's split rule; the engine's greedy outputs with it equal to those without it and to
transformers, with the kernel really taking the few-row steps; LoRA on top of it; bad settings refused by name; the
kernel's sm_90 build."""

import json
import os
import random

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' definition

import pytest
from conftest import (
    TRITON_DEVICE,
    RerunGraph,
    extension_or_skip,
    graphs_on_a_cpu,
    hf_greedy,
    random_prompts,
    refused,
    sm90_builds,
)

gemv = extension_or_skip("gemv")
fusions = extension_or_skip("gemv_fusions")

from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.config import EngineConfig  # noqa: E402
from nanoserve.fused_ops import add_rms_norm_ref, silu_and_mul_ref  # noqa: E402

DEVICE = TRITON_DEVICE
ENGINE = {"device": "cpu", "max_model_len": 128, "num_kvcache_blocks": 64}
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(autouse=True)
def fresh_seed():
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    random.seed(seed)
    print(f"seed {seed}")


def draw_projection(dtype, split_k=None, kind=None):
    """A random projection and its input: 1..16 rows, output and inner sizes that fill no tile exactly (or do), a
    bias or none, a split of the inner dimension from 1 to 8, and an input that is plain, or [gate | up] to apply
    SiLU-and-mul to (a down projection's, fused), or a NormedRows (q|k|v's or gate|up's, the add + RMSNorm fused),
    whose residual rows have a scale of their own (so that a row normed by another row's RMS is seen)."""
    rows, out_features = random.randint(1, gemv.MAX_ROWS), random.choice([random.randint(1, 150), 64])
    in_features = random.choice([random.randint(1, 700), 256])
    split_k = split_k or random.choice([1, 2, 4, 8])
    kind = kind or random.choice(["plain", "silu", "norm"])
    x = torch.randn(rows, in_features * (2 if kind == "silu" else 1), device=DEVICE).to(dtype)
    if kind == "norm":
        x = draw_normed_rows(x, dtype)
    weight = (torch.randn(out_features, in_features, device=DEVICE) / in_features**0.5).to(dtype)
    bias = torch.randn(out_features, device=DEVICE).to(dtype) if random.random() < 0.5 else None
    return x, weight, bias, split_k, kind == "silu"


def draw_normed_rows(x, dtype):
    """x as a NormedRows, with rows of its own row strides: x, the residual and the stream are each column slices of
    wider buffers (a stride mixed up for another's shows), the stream's buffer full of NaN with rows to spare (a write
    outside the stream's rows and columns shows: see written_outside); the residual's rows have scales of their own
    (a row normed by another's RMS shows), and row 0 of x is minus the residual's, a sum of exactly 0 (eps dropped:
    0 / 0), with more rows or half the time with one."""
    rows, width = x.shape
    x = torch.cat([x, torch.randn(rows, 5, device=DEVICE).to(dtype)], 1)[:, :width]
    residual = torch.randn(rows, width + 3, device=DEVICE) * torch.rand(rows, 1, device=DEVICE) * 4
    residual = residual.to(dtype)[:, 1 : width + 1]
    if rows > 1 or random.random() < 0.5:
        residual[0] = -x[0]
    stream = torch.full((rows + 2, width + 7), float("nan"), device=DEVICE, dtype=dtype)[1 : rows + 1, 2 : width + 2]
    norm_weight = (torch.rand(width, device=DEVICE) + 0.5).to(dtype)
    return fusions.NormedRows(x, residual, stream, norm_weight, random.choice([1e-6, 1e-5]))


def written_outside(stream):
    """Elements of a NormedRows' stream buffer (draw_normed_rows: NaN to start with) written outside the stream."""
    whole = torch.empty(0, dtype=stream.dtype, device=stream.device).set_(stream.untyped_storage())
    return int((~whole.isnan()).sum()) - stream.numel()


def kernel_input(x, silu_input):
    """What the kernel multiplies by the weight, by the PyTorch references (rounded to the dtype, as the kernel rounds
    it), and the stream a NormedRows must leave (None for other inputs)."""
    if isinstance(x, fusions.NormedRows):
        return add_rms_norm_ref(x.x, x.residual, x.weight, x.eps)
    return (silu_and_mul_ref(x) if silu_input else x), None


# bf16 only on a GPU: Triton's interpreter computes bf16 dots wrongly
BF16_ON_GPU = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(DEVICE != "cuda", reason="bf16 dots need a GPU"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16_ON_GPU])
def test_kernel_equals_the_reference_and_a_plain_matmul(dtype):
    """Guards against a row, feature or inner element missed or counted twice (a split's range, a tile's mask), a split
    summed twice or not at all, the bias added per split, a counter left non-zero (the next launch would have no
    last program, or the wrong one), or a fused norm's mean square taken over part of a row, its weight dropped, or
    its stream written wrongly or in part: seven drawn projections (one of each input kind split 4 ways, then any)
    through one shared workspace, each twice, against the reference and against an fp64 matmul of the same numbers;
    the counters are zero after every launch, and a NormedRows' stream holds x + residual exactly (the reference's
    sum in the dtype)."""
    shapes = [draw_projection(dtype, 4, kind) for kind in ("plain", "silu", "norm")]
    shapes += [draw_projection(dtype) for _ in range(4)]
    plans = [(s, -(-w.shape[0] // gemv.BLOCK_N) * s) for _, w, _, s, _ in shapes]
    workspace = gemv.Workspace(plans, torch.device(DEVICE))
    tolerance = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    for x, weight, bias, split_k, silu_input in shapes * 2:
        got = gemv.gemv(x, weight, bias, split_k, workspace, silu_input)
        x_in, stream = kernel_input(x, silu_input)
        if stream is not None:  # the kernel's stream, checked before the reference overwrites it
            assert torch.equal(x.stream, stream) and written_outside(x.stream) == 0, "the stream x + residual"
        truth = x_in.double() @ weight.double().T + (0 if bias is None else bias.double())
        reference = gemv.gemv_ref(x, weight, bias, split_k, workspace, silu_input)
        shape = (len(x), *weight.shape, split_k, bias is not None, silu_input, stream is not None)
        assert got.dtype == dtype and got.shape == truth.shape, shape
        torch.testing.assert_close(
            got.double(), truth, atol=tolerance, rtol=tolerance, msg=lambda m, shape=shape: f"{shape}: {m}"
        )
        torch.testing.assert_close(
            got, reference, atol=tolerance, rtol=tolerance, msg=lambda m, shape=shape: f"{shape}: {m}"
        )
        assert not workspace.counters.any(), f"{shape}: a counter left non-zero"


def test_the_normed_input_is_rounded_as_the_norm_kernel_rounds_it():
    """Guards against the fused add + RMSNorm rounding otherwise than the norm's own kernel (the normed value rounded to
    the dtype before the weight multiplies it, the sum in the dtype): through an identity projection in fp16 (every
    product exact, each output one input element), the GEMV gives add_rms_norm_ref's normed rows, all but a few
    elements exactly (the fp32 mean square's summing order may move a normed value by an ulp, which the weight's
    product, rounded again, can make two ulps of the output; rounding once instead of twice moves about a quarter of
    them)."""
    width, rows = random.choice([128, 256, 384]), random.randint(1, fusions.NORM_MAX_ROWS)
    normed = draw_normed_rows(torch.randn(rows, width, device=DEVICE).to(torch.float16), torch.float16)
    workspace = gemv.Workspace([(2, 2 * width // gemv.BLOCK_N)], torch.device(DEVICE))
    got = gemv.gemv(normed, torch.eye(width, device=DEVICE).half(), None, 2, workspace)
    want, _ = add_rms_norm_ref(normed.x, normed.residual, normed.weight, normed.eps)
    assert (got != want).float().mean() < 0.02
    torch.testing.assert_close(got, want, atol=0, rtol=2**-9)  # two ulps


def draw_rotation(rows, num_q_heads, num_kv_heads, head_dim, dtype, qk_norm):
    """A Rotation for q|k|v's GEMV and a copy of it with caches of its own: positions anywhere in a 64-row RoPE table
    (a table of random angles: any mix-up of rows shows), distinct cache slots in 4 blocks of 8 (the last row's a padded
    one, PAD_SLOT, half the time), caches of random values (a store to a wrong slot, head or half shows), and Qwen3's
    QK-norm weights or none."""
    angles = torch.rand(64, head_dim // 2, device=DEVICE) * 6.3
    caches = [torch.randn(4, 8, num_kv_heads, head_dim, device=DEVICE).to(dtype) for _ in range(2)]
    slots = torch.randperm(32, device=DEVICE)[:rows].int()
    if rows > 1 and random.random() < 0.5:
        slots[-1] = -1  # attention.PAD_SLOT
    norms = ()
    if qk_norm:
        norms = tuple((torch.rand(head_dim, device=DEVICE) + 0.5).to(dtype) for _ in range(2)) + (1e-6,)
    positions = torch.randint(0, 64, (rows,), device=DEVICE).int()
    rotation = fusions.Rotation(positions, angles.cos(), angles.sin(), *caches, slots, *norms)
    return rotation, rotation._replace(k_cache=caches[0].clone(), v_cache=caches[1].clone())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16_ON_GPU])
def test_rotation_in_the_epilogue_equals_the_reference(dtype):
    """Guards against the QK-norm + RoPE + K/V store in q|k|v's GEMV (the last tile's program) going wrong: a head, a
    half or a row missed, rotated before the tiles were all written, the norm's weight or eps dropped, a K/V row stored
    in the wrong slot (or a padded row's stored), V rotated, the grid's counter left non-zero: q|k|v projections of 1 or
    2 rows with drawn head counts, head sizes, splits and inputs (plain or a NormedRows), with and without QK-norm and a
    bias, twice each through one workspace, against gemv_ref with the same rotation (fused_ops' references): the q
    heads and both caches, every element. (The interpreter runs the programs in grid order, so a wrong choice of the
    last program shows only where it picks an earlier one; the GPU run of this test is the check of the arrival.)"""
    tolerance = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    for _ in range(6):
        rows = random.randint(1, fusions.ROTATE_MAX_ROWS)
        num_kv_heads, group, head_dim = random.choice([1, 2, 3]), random.choice([1, 2]), random.choice([16, 32])
        out_features = (num_kv_heads * (group + 2)) * head_dim
        in_features, split_k = random.randint(16, 300), random.choice([1, 2, 4])
        x = torch.randn(rows, in_features, device=DEVICE).to(dtype)
        x = draw_normed_rows(x, dtype) if random.random() < 0.5 else x
        weight = (torch.randn(out_features, in_features, device=DEVICE) / in_features**0.5).to(dtype)
        bias = torch.randn(out_features, device=DEVICE).to(dtype) if random.random() < 0.5 else None
        rotation, ref_rotation = draw_rotation(
            rows, num_kv_heads * group, num_kv_heads, head_dim, dtype, random.random() < 0.7
        )
        tiles = -(-out_features // gemv.BLOCK_N)
        workspace = gemv.Workspace([(split_k, tiles * split_k)], torch.device(DEVICE))
        shape = (
            rows,
            num_kv_heads,
            group,
            head_dim,
            in_features,
            split_k,
            bias is not None,
            rotation.q_weight is not None,
        )
        for _ in range(2):  # the second launch finds the counters as the first left them
            got = gemv.gemv(x, weight, bias, split_k, workspace, False, rotation)
            want = gemv.gemv_ref(x, weight, bias, split_k, workspace, False, ref_rotation)
            q_size = num_kv_heads * group * head_dim
            check = {"q": (got[:, :q_size], want[:, :q_size]), "k cache": (rotation.k_cache, ref_rotation.k_cache)}
            check["v cache"] = (rotation.v_cache, ref_rotation.v_cache)
            for name, (a, b) in check.items():
                torch.testing.assert_close(
                    a, b, atol=tolerance, rtol=tolerance, msg=lambda m, name=name, shape=shape: f"{shape} {name}: {m}"
                )
            assert not workspace.counters.any(), f"{shape}: a counter left non-zero"


def test_the_rotation_builds_are_warmed_up_without_storing(tiny_model, monkeypatch):
    """Guards against the warm-up that compiles the fusions' builds at start on a GPU (so that an eager engine compiles
    none in a step) writing into the KV cache or leaving a counter set, or not running them: the first layer's q|k|v
    at 1 and 2 rows, with the input it takes (a NormedRows), with the norm alone and then with the rotation and Qwen3's
    QK-norm, the caches unchanged and the counters zero after."""
    path, _ = tiny_model("qwen3")
    llm = LLM(path, **ENGINE, kernels="triton", small_batch_gemv=True, enforce_eager=True)
    model, kv_cache = llm.runner.model, llm.runner.kv_caches[0]
    for cache in kv_cache:
        cache.copy_(torch.randn_like(cache))
    before = [cache.clone() for cache in kv_cache]
    qkv = model.model.layers[0].self_attn.qkv_proj
    seen = []
    real = qkv.gemv
    monkeypatch.setattr(
        qkv, "gemv", lambda x, *args: seen.append((len(x), type(x).__name__, args[-1] is not None)) or real(x, *args)
    )
    fusions.warm_up_fusions(model, kv_cache)
    # each row count: the norm in the load alone (q|k|v takes it so at 3-4 rows), then with the rotation too
    assert seen == [
        (1, "NormedRows", False),
        (1, "NormedRows", True),
        (2, "NormedRows", False),
        (2, "NormedRows", True),
    ]
    assert all(torch.equal(a, b) for a, b in zip(kv_cache, before, strict=True))
    assert not qkv.workspace.counters.any()


def test_the_plan_splits_until_the_grid_fills_the_gpu():
    """The split rule on Qwen3-0.6B's projections on an H100 (132 SMs) as BENCHMARKS.md states it, and on drawn
    shapes: splits are powers of two, a split doubles only while the grid has under PROGRAMS_PER_SM programs per SM
    and each split keeps MIN_SPLIT_TILES tiles, and the programs are the tiles times the splits."""
    qwen3 = {
        "qkv": (4096, 1024),
        "o": (1024, 2048),
        "gate_up": (6144, 1024),
        "down": (1024, 3072),
        "lm": (151936, 1024),
    }
    assert {name: gemv.plan(*shape, 132)[0] for name, shape in qwen3.items()} == {
        "qkv": 4,
        "o": 8,
        "gate_up": 2,
        "down": 8,
        "lm": 1,
    }
    for _ in range(200):
        out_features, in_features, num_sms = random.randint(1, 9000), random.randint(1, 9000), random.randint(1, 200)
        split_k, programs = gemv.plan(out_features, in_features, num_sms)
        tiles = -(-out_features // gemv.BLOCK_N)
        assert programs == tiles * split_k and split_k & (split_k - 1) == 0
        if split_k > 1:
            assert in_features >= split_k * gemv.MIN_SPLIT_TILES * gemv.BLOCK_K
            assert tiles * split_k // 2 < gemv.PROGRAMS_PER_SM * num_sms
        may_double = in_features >= 2 * split_k * gemv.MIN_SPLIT_TILES * gemv.BLOCK_K
        assert programs >= gemv.PROGRAMS_PER_SM * num_sms or not may_double


def forced_splits(split_k: int):
    """A stand-in for gemv.plan that splits every projection split_k ways: the tiny models' 64-128 inner features
    would never split by the plan's rule, and the engine's shared workspace and counters must see the handshake."""

    def plan(out_features: int, in_features: int, num_sms: int) -> tuple[int, int]:
        return split_k, -(-out_features // gemv.BLOCK_N) * split_k

    return plan


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_engine_outputs_are_unchanged_and_the_gemv_runs(tiny_model, monkeypatch, kernels):
    """Guards against the engine's use of it (a projection not wrapped, q|k|v split wrongly, the LM head's rows, a
    prefill of more than MAX_ROWS rows sent to it, projections of different tile counts sharing one workspace and one
    set of counters, SiLU-and-mul applied twice or never once it moves into the down projection): greedy tokens with
    the GEMV, every projection split 2 ways, equal those without it and transformers', for Qwen2 (q|k|v with a bias);
    the norms moved into q|k|v and gate|up (a residual stream lost or written in part would change the tokens), and
    the rotation and K/V store into q|k|v once 1-2 sequences are left (the three stop after 8, 3 and 5 tokens: a
    K/V row lost, or q rotated twice or never, would change the tokens); every wrapped projection ran it in a few-row
    step, and never on more than MAX_ROWS rows."""
    monkeypatch.setattr(gemv, "plan", forced_splits(2))
    path, hf = tiny_model("qwen2")
    prompts = random_prompts([21, 5, 9])
    lengths = [8, 3, 5]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    # on a GPU the kernels run there (not in the interpreter): with the decode graphs, then eagerly, so that every
    # call passes the counter below
    engine = ENGINE | {"kernels": kernels, "device": DEVICE if kernels == "triton" else "cpu", "dtype": "float32"}
    plain = [o.outputs[0].token_ids for o in LLM(path, **engine).generate(prompts, params, use_tqdm=False)]
    if engine["device"] == "cuda":  # and with the decode graphs captured again over the GEMV
        graphed = LLM(path, **engine, small_batch_gemv=True).generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in graphed] == plain
    llm = LLM(path, **engine, small_batch_gemv=True, enforce_eager=True)
    wrapped = [m for m in llm.runner.model.modules() if isinstance(m, gemv.FewRowLinear)]
    assert len(wrapped) == 4 * len(llm.runner.model.model.layers) + 1 and {m.split_k for m in wrapped} == {2}
    for layer in llm.runner.model.model.layers:  # SiLU-and-mul moved into each down projection's load, the norms
        # into q|k|v's and gate|up's, the rotation into q|k|v's epilogue
        assert layer.mlp.down_proj.silu_and_mul is not None and layer.kernels.silu_and_mul is fusions.gate_and_up
        assert isinstance(layer.input_layernorm, fusions.NormIntoProjection)
        assert isinstance(layer.post_attention_layernorm, fusions.NormIntoProjection)
        assert isinstance(layer.self_attn, fusions.RotatingAttention)
    rows_seen = {id(m): [] for m in wrapped}
    normed_rows_seen = {id(m): [] for m in wrapped}
    rotated_rows_seen = {id(m): [] for m in wrapped}
    for module in wrapped:
        real = module.gemv

        def counting(x, *args, module=module, real=real):
            rows_seen[id(module)].append(len(x))
            if isinstance(x, fusions.NormedRows):
                normed_rows_seen[id(module)].append(len(x))
            if args[-1] is not None:  # a Rotation
                rotated_rows_seen[id(module)].append(len(x))
            return real(x, *args)

        monkeypatch.setattr(module, "gemv", counting)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == plain == [hf_greedy(hf, p, n) for p, n in zip(prompts, lengths, strict=True)]
    assert all(rows_seen.values()), "a wrapped projection never took the GEMV"
    assert max(max(rows) for rows in rows_seen.values()) <= gemv.MAX_ROWS
    fed = {id(module) for module in fusions.fed_by_norms(llm.runner.model)}  # each layer's q|k|v and gate|up
    assert len(fed) == 2 * len(llm.runner.model.model.layers)
    qkv = {id(layer.self_attn.qkv_proj) for layer in llm.runner.model.model.layers}
    for module in wrapped:  # the 3 sequences' decode steps: the norms in q|k|v's and gate|up's loads, only there; the
        # rotation in q|k|v's epilogue at 1-2 rows, only there
        assert bool(normed_rows_seen[id(module)]) == (id(module) in fed)
        assert max(normed_rows_seen[id(module)], default=0) <= fusions.NORM_MAX_ROWS
        assert bool(rotated_rows_seen[id(module)]) == (id(module) in qkv)
        assert max(rotated_rows_seen[id(module)], default=0) <= fusions.ROTATE_MAX_ROWS
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU stand-in; the GPU engine test replays real graphs")
def test_decode_graphs_are_captured_again_over_the_gemv(tiny_model, monkeypatch):
    """Guards against the CUDA-graph path's GEMV bugs on a CPU: graphs captured before the projections were wrapped
    (the engine's start must capture new ones over them), and counters or partials left over from one replay (or one
    graph size) spoiling the next. 'Capture' runs the forward eagerly and each replay reruns it on the static buffers,
    with the Triton kernels in the interpreter and every projection split 2 ways: 5 sequences (a graph of 8, then
    smaller ones as they finish, the last 8 steps one sequence alone: the rotation in q|k|v's epilogue, with Qwen3's
    QK-norm) give the eager engine's tokens without the GEMV, and the counters end at zero."""
    monkeypatch.setattr(gemv, "plan", forced_splits(2))
    path, _ = tiny_model("qwen3")
    prompts = random_prompts([7, 19, 11, 24, 5])
    lengths = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 8, 5, 16, 6)]
    engine = ENGINE | {"kernels": "triton", "dtype": "float32", "max_num_seqs": 8}
    eager = [o.outputs[0].token_ids for o in LLM(path, **engine).generate(prompts, lengths, use_tqdm=False)]
    captured = graphs_on_a_cpu(monkeypatch)
    llm = LLM(path, **engine, small_batch_gemv=True)
    graphs = llm.runner.graphs
    assert len(captured) == 2 and graphs is captured[1]  # the runner's, then the engine start's over the GEMV
    assert isinstance(graphs.model.model.layers[0].self_attn.qkv_proj, gemv.FewRowLinear)
    graphs.graphs = {size: RerunGraph(graphs, size) for size in graphs.graphs}
    graphs.replays = 0
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, lengths, use_tqdm=False)]
    assert got == eager and graphs.replays >= 7
    workspace = graphs.model.lm_head.workspace
    assert not workspace.counters.any() and not graphs.split_counters.any()
    assert llm.stats()["kv_blocks_used"] == 0


def test_norms_stay_apart_in_rows_wider_than_the_gemv_takes(tiny_model, monkeypatch):
    """Guards against the norm fusion on rows wider than its unrolled mean square was built for (its registers grow
    with the width): with NORM_MAX_WIDTH below the model's width, the norms stay the layer's own; SiLU-and-mul still
    moves."""
    path, _ = tiny_model("qwen3")
    monkeypatch.setattr(fusions, "NORM_MAX_WIDTH", 32)
    llm = LLM(path, **ENGINE, small_batch_gemv=True, enforce_eager=True)
    for layer in llm.runner.model.model.layers:
        assert llm.runner.model.args.hidden_size > 32 and layer.kernels.silu_and_mul is fusions.gate_and_up
        assert not isinstance(layer.input_layernorm, fusions.NormIntoProjection)
        assert not isinstance(layer.post_attention_layernorm, fusions.NormIntoProjection)
    assert not fusions.fed_by_norms(llm.runner.model)


def test_lora_wraps_the_wrapped_projections(tiny_model, tmp_path):
    """Guards against LoRA losing its adapters (or q|k|v's shards) on projections the GEMV wrapped: with both on, a
    request under an adapter gives the tokens it gives with LoRA alone, which differ from the base model's."""
    pytest.importorskip("safetensors")
    extension_or_skip("lora")
    from safetensors.torch import save_file

    from nanoserve.ext.lora import LoRARequest

    path, _ = tiny_model("qwen3")
    llm = LLM(path, **ENGINE, enable_lora=True, max_loras=2, small_batch_gemv=True)
    args, rank = llm.runner.model.args, 4
    # k of q|k|v and up of gate|up: a shard that is not the first, of each merged projection
    sizes = {("self_attn", "k_proj"): args.num_kv_heads * args.head_dim, ("mlp", "up_proj"): args.intermediate_size}
    tensors = {}
    for i in range(args.num_layers):
        for (part, name), size in sizes.items():
            prefix = f"base_model.model.model.layers.{i}.{part}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, args.hidden_size) / 4
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(size, rank) / 4
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "target_modules": ["k_proj", "up_proj"]}))
    save_file(tensors, folder / "adapter_model.safetensors")
    adapter = LoRARequest("k-up", 1, str(folder))
    prompts = random_prompts([11, 6])
    both = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=adapter)]
    base = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    alone = LLM(path, **ENGINE, enable_lora=True, max_loras=2)
    lora_only = [o.outputs[0].token_ids for o in alone.generate(prompts, GREEDY, use_tqdm=False, lora_request=adapter)]
    assert both == lora_only != base
    for layer in llm.runner.model.model.layers:  # LoRA's adapters read SiLU-and-mul's output and the normed
        # input: neither fused
        assert layer.kernels.silu_and_mul is not fusions.gate_and_up
        assert not isinstance(layer.input_layernorm, fusions.NormIntoProjection)
        assert not isinstance(layer.self_attn, fusions.RotatingAttention)


def test_bad_settings_are_refused_by_name():
    refused("small_batch_gemv", EngineConfig, device="cpu", small_batch_gemv=1)
    refused("small_batch_gemv", EngineConfig, device="cpu", small_batch_gemv=True, tensor_parallel_size=2)


def test_kernel_compiles_for_h100_without_spills():
    """Guards against a kernel that only Triton's interpreter accepts, and against the handshakes losing their memory
    order: in bf16 and fp32, with one split, with four (and a bias), with four and SiLU-and-mul in its input load, with
    four and an add + RMSNorm of the widest rows it takes (NORM_MAX_WIDTH) there, and with the rotation of Qwen3-0.6B's
    q|k|v heads (16 and 8 of 128; one split with a bias, and four with the norm of its 1,024-wide rows: in fp32 the
    norm of 4,096-wide rows and the rotation together spill on triton 3.9), the kernel compiles for an H100
    (sm_90) without spills, its weight tiles loaded ahead by 16-byte asynchronous copies (the software pipeline); with
    splits or a rotation, a barrier lies between the stores and each counter's add (a tile's, the grid's), each
    acquire-release at GPU scope; with splits, the partials are read past L1; launched as a programmatic dependent
    (sm_90's only launch), each program lets the next kernel start and prefetches its weight's first lines, and
    reads or writes nothing in global memory before its griddepcontrol.wait."""
    script = """
from nanoserve.ext import gemv as G, gemv_fusions as FU
for dtype in ("*bf16", "*fp32"):
    for split_k, bias, silu, norm, rotate in ((1, False, False, False, False), (4, True, False, False, False),
                                              (4, False, True, False, False), (4, False, False, True, False),
                                              (1, True, False, False, True), (4, False, False, True, True)):
        names = ("x_ptr", "w_ptr", "bias_ptr", "y_ptr", "residual_ptr", "stream_ptr", "norm_w_ptr", "k_cache_ptr",
                 "v_cache_ptr") + (("q_norm_ptr", "k_norm_ptr") if rotate else ())
        types = {name: dtype for name in names} | {"partials_ptr": "*fp32", "counters_ptr": "*i32", "eps": "fp32",
                 "positions_ptr": "*i32", "slot_mapping_ptr": "*i32", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                 "qk_eps": "fp32"}
        heads = {"HALF": 64, "Q_HEADS_PAD": 16, "K_HEADS_PAD": 8, "CACHE_BLOCK": 16} if rotate else {"HALF": 1,
                 "Q_HEADS_PAD": 1, "K_HEADS_PAD": 1, "CACHE_BLOCK": 1, "q_norm_ptr": None, "k_norm_ptr": None}
        width = 1024 if rotate else FU.NORM_MAX_WIDTH
        constants = {"HAS_BIAS": bias, "SILU_INPUT": silu, "NORM_INPUT": norm, "ROTATE": rotate, "PAD": -1,
                     "NORM_TILES": width // G.BLOCK_K, "SPLIT_K": split_k, "K_PER_SPLIT": 512,
                     "BLOCK_M": G.MAX_ROWS, "BLOCK_N": G.BLOCK_N, "BLOCK_K": G.BLOCK_K, "DEPENDENT": True,
                     "PREFETCH_LINES": G.PREFETCH_LINES} | heads
        look_for = ("atom.global.gpu.acq_rel.add", "ld.global.cg", "griddepcontrol.launch_dependents",
                    "prefetch.global.L2")
        built = sm90_build.build(G._gemv_kernel, types, constants, G.NUM_WARPS, look_for, aligned=("N", "K"))
        print(json.dumps(built | {"split_k": split_k, "rotate": rotate}))
"""
    builds = sm90_builds(script)
    assert len(builds) == 12, builds
    for b in builds:
        assert b["spill_bytes"] == 0 and 16 in b["async_copy_bytes"], b
        handshake = b["split_k"] > 1 or b["rotate"]
        assert b["acq_rel_atomics"] == (b["split_k"] > 1) + b["rotate"], b  # a tile's arrival, the grid's
        assert b["barrier_before_atomic"] == (True if handshake else None), b  # before each of them
        assert b["found"]["ld.global.cg"] == (b["split_k"] > 1), b
        # a programmatic dependent: it lets the next kernel start, prefetches, and touches nothing before its wait
        assert b["found"]["griddepcontrol.launch_dependents"] and b["found"]["prefetch.global.L2"], b
        assert b["waits_before_memory"] is True, b


@pytest.mark.parametrize("chosen", [True, False])
def test_a_dependent_launch_always_comes_with_its_wait(monkeypatch, chosen):
    """Guards against a programmatic dependent launch whose kernel does not wait (it would read x before the kernel
    that writes it has finished), and against one asked for where the GPU has none: the launch's launch_pdl and the
    kernel's DEPENDENT (its griddepcontrol.wait, built and ordered in test_kernel_compiles_for_h100_without_spills)
    are both the workspace's choice, made once: CUDA devices of sm_90 and later, never a CPU, never with
    DEPENDENT_LAUNCH off."""
    capability = {"capability": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability["capability"])
    assert gemv.dependent_launch(torch.device("cuda"))
    assert not gemv.dependent_launch(torch.device("cpu"))
    capability["capability"] = (8, 0)
    assert not gemv.dependent_launch(torch.device("cuda"))
    capability["capability"] = (10, 0)
    assert gemv.dependent_launch(torch.device("cuda"))
    monkeypatch.setattr(gemv, "DEPENDENT_LAUNCH", False)
    assert not gemv.dependent_launch(torch.device("cuda"))
    launches = []

    class Recorder:  # stands in for _gemv_kernel[grid](...)
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(kwargs)

    workspace = gemv.Workspace([(2, 8)], torch.device("cpu"))
    assert workspace.dependent_launch is False
    workspace.dependent_launch = chosen
    monkeypatch.setattr(gemv, "_gemv_kernel", Recorder())
    weight = torch.randn(64, 256)
    gemv.gemv(torch.randn(2, 256), weight, None, 2, workspace)
    (kwargs,) = launches
    assert kwargs["DEPENDENT"] is chosen and kwargs["launch_pdl"] is chosen


def test_attention_launches_as_a_dependent_between_the_weight_reads(tiny_model, monkeypatch):
    """Guards against the attention between q|k|v's GEMV and o's staying a plain launch where the GEMV is a
    programmatic dependent (o's programs could then not be placed, nor prefetch, while attention runs), and against
    either asked for where the device has none: in a real generation every GEMV and every decode attention launch
    asks for a dependent launch (launch_pdl and DEPENDENT both) exactly when the workspace does, and the tokens are
    the same either way. The interpreter cannot run griddepcontrol, so each launch is recorded, then run plainly."""
    from nanoserve import attention

    path, _ = tiny_model("qwen3")
    asked = set()

    class AsPlain:  # stands in for a kernel: records how it was launched, then launches the real one plainly
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                asked.add((self.name, kwargs["DEPENDENT"], kwargs["launch_pdl"]))
                return self.kernel[grid](*args, **kwargs | {"DEPENDENT": False, "launch_pdl": False})

            return launch

    monkeypatch.setattr(gemv, "_gemv_kernel", AsPlain("gemv", gemv._gemv_kernel))
    monkeypatch.setattr(attention, "_decode_split_kernel", AsPlain("attention", attention._decode_split_kernel))
    prompts = random_prompts([9, 4])
    tokens = {}
    for dependent in (True, False):
        monkeypatch.setattr(gemv, "dependent_launch", lambda device, dependent=dependent: dependent)
        llm = LLM(path, **ENGINE, kernels="triton", small_batch_gemv=True)
        asked.clear()
        tokens[dependent] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert asked == {("gemv", dependent, dependent), ("attention", dependent, dependent)}
    assert tokens[True] == tokens[False]
