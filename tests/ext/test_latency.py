"""Batch 1's latency kernels (nanoserve/ext/latency): the split-K GEMV and the decode attention whose last split
merges, each against its PyTorch reference on freshly drawn shapes (in Triton's interpreter on a CPU; tests marked gpu
run there too, and on the GPU with `pytest -m gpu`); a stress test of their arrival counters, many launches on the same
counters, in and out of a CUDA graph; the split rules; the dependent launch and its wait; the engine's greedy outputs
with the extension equal to those without it and to transformers, on both backends; LoRA on top; bad settings refused
by name; the GEMV's sm_90 build (the decode kernel's builds are tests/test_sm90_build.py's, beside the core's)."""

import json
import os
import random

import pytest
import torch
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
from test_attention import ATOL, assert_close, heads, make_batch, randint

latency = extension_or_skip("latency")

from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve import attention as core  # noqa: E402
from nanoserve.config import EngineConfig  # noqa: E402
from nanoserve.ext.latency import decode  # noqa: E402
from nanoserve.ext.latency import gemv as G  # noqa: E402
from nanoserve.layer_ops import silu_and_mul_ref  # noqa: E402

DEVICE = TRITON_DEVICE  # where the kernels run: the GPU, or the CPU's interpreter
ON_GPU = DEVICE == "cuda"
ENGINE = {"max_model_len": 128, "num_kvcache_blocks": 64}
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# bf16 only on a GPU: Triton's interpreter computes bf16 dots wrongly
BF16_ON_GPU = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not ON_GPU, reason="bf16 dots need a GPU"))


@pytest.fixture(autouse=True)
def fresh_seed():
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    random.seed(seed)
    print(f"seed {seed}")


@pytest.fixture
def nan_for_new_buffers(monkeypatch):
    """Outputs and partials the launchers allocate start as NaN, so an element no program writes fails the test
    (a freed buffer's old, right values would hide it)."""
    with torch.device("cpu"):  # (torch's device context caches the factory functions on first use: the real ones)
        torch.empty(0)
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: poison(empty(*args, **kwargs)))
    monkeypatch.setattr(torch, "empty_like", lambda *args, **kwargs: poison(empty_like(*args, **kwargs)))


class Recorder:
    """Stands in for a kernel, kernel[grid](*args, **kwargs): records each launch's arguments (args in `positional`,
    kwargs in `launches`), then launches `then` (the real kernel) with them, or nothing."""

    def __init__(self, then=None):
        self.then = then
        self.positional = []
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.positional.append(args)
            self.launches.append(kwargs)
            if self.then is not None:
                self.then[grid](*args, **kwargs)

        return launch


# ---- the GEMV --------------------------------------------------------------------------------------------------------
def draw_projection(dtype, split_k=None, silu=None):
    """A random projection and its input: 1..16 rows, output and inner sizes that fill no tile exactly (or do), a
    bias or none, a split of the inner dimension from 1 to 8, and an input that is plain or [gate | up] (a down
    projection's, SiLU-and-mul in its load)."""
    rows, out_features = random.randint(1, G.MAX_ROWS), random.choice([random.randint(1, 150), 64])
    in_features = random.choice([random.randint(1, 700), 256])
    split_k = split_k or random.choice([1, 2, 4, 8])
    silu = random.random() < 0.5 if silu is None else silu
    x = torch.randn(rows, in_features * (2 if silu else 1), device=DEVICE).to(dtype)
    weight = (torch.randn(out_features, in_features, device=DEVICE) / in_features**0.5).to(dtype)
    bias = torch.randn(out_features, device=DEVICE).to(dtype) if random.random() < 0.5 else None
    return x, weight, bias, split_k, silu


def workspace_for(shapes) -> "G.Workspace":
    """One workspace with room for every drawn projection, as the engine's start makes one for all."""
    workspace = G.Workspace(torch.device(DEVICE))
    for _, weight, _, split_k, _ in shapes:
        workspace.reserve(weight.shape[0], split_k)
    return workspace


@pytest.mark.gpu
@pytest.mark.usefixtures("nan_for_new_buffers")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16_ON_GPU])
def test_gemv_equals_the_reference_and_a_plain_matmul(dtype):
    """Guards against a row, feature or inner element missed or counted twice (a split's range, a tile's mask), a split
    summed twice or not at all, the bias added per split, SiLU-and-mul rounded otherwise than its kernel, or a counter
    left non-zero (the next launch would have no last program, or the wrong one): six drawn projections (plain and
    [gate | up] inputs split 4 ways, then any) through one shared workspace, each twice, against the reference and an
    fp64 matmul of the same numbers; the counters are zero after every launch."""
    shapes = [draw_projection(dtype, 4, silu) for silu in (False, True)] + [draw_projection(dtype) for _ in range(4)]
    workspace = workspace_for(shapes)
    tolerance = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    for x, weight, bias, split_k, silu in shapes * 2:
        got = G.gemv(x, weight, bias, split_k, workspace, silu)
        x_in = silu_and_mul_ref(x) if silu else x  # rounded to the dtype, as the kernel rounds it
        truth = x_in.double() @ weight.double().T + (0 if bias is None else bias.double())
        reference = G.gemv_ref(x, weight, bias, split_k, workspace, silu)
        shape = (len(x), *weight.shape, split_k, bias is not None, silu)
        assert got.dtype == dtype and got.shape == truth.shape, shape
        for want in (truth, reference.double()):
            torch.testing.assert_close(
                got.double(), want, atol=tolerance, rtol=tolerance, msg=lambda m, shape=shape: f"{shape}: {m}"
            )
        assert not workspace.counters.any(), f"{shape}: a counter left non-zero"


def test_the_plan_splits_until_the_grid_fills_the_gpu():
    """The split rule on Qwen3-0.6B's projections on an H100 (132 SMs), as BENCHMARKS.md states it, and on drawn
    shapes: splits are powers of two, a split doubles only while the grid has under PROGRAMS_PER_SM programs per SM
    and each split keeps MIN_SPLIT_TILES tiles."""
    qwen3 = {
        "qkv": (4096, 1024),
        "o": (1024, 2048),
        "gate_up": (6144, 1024),
        "down": (1024, 3072),
        "lm": (151936, 1024),
    }
    splits = {name: G.plan(*shape, 132) for name, shape in qwen3.items()}
    assert splits == {"qkv": 4, "o": 8, "gate_up": 2, "down": 8, "lm": 1}
    for _ in range(200):
        out_features, in_features, num_sms = random.randint(1, 9000), random.randint(1, 9000), random.randint(1, 200)
        split_k = G.plan(out_features, in_features, num_sms)
        programs = -(-out_features // G.BLOCK_N) * split_k
        assert split_k & (split_k - 1) == 0
        if split_k > 1:
            assert in_features >= split_k * G.MIN_SPLIT_TILES * G.BLOCK_K
            assert programs // 2 < G.PROGRAMS_PER_SM * num_sms
        may_double = in_features >= 2 * split_k * G.MIN_SPLIT_TILES * G.BLOCK_K
        assert programs >= G.PROGRAMS_PER_SM * num_sms or not may_double


# ---- the decode attention --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.usefixtures("nan_for_new_buffers")
@pytest.mark.parametrize("group", [1, 2, 8])
def test_the_last_split_merges_and_leaves_the_counters_at_zero(group):
    """Guards against the in-kernel merge (the last of a (sequence, KV head)'s split programs to arrive merges every
    split's partials) merging too early or twice, weighting a split wrongly, missing a query head of the group, or
    leaving its counter non-zero, which would break the next layer's launch (a CUDA graph replays the same counters):
    one DecodeAttention through three launches, as three layers use it, each equal to the reference and the same
    every time (the merge sums in split order, whichever split arrives last); contexts of 0 keys (a graph's padded
    rows) give 0. Triton's interpreter runs the programs one at a time, in one order, so only a GPU run of this test
    sees splits arrive at once; the sm_90 build checks the handshake's memory order."""
    num_seqs = randint(1, 3)
    context_lens = [randint(1, 400) for _ in range(num_seqs)] + [0]
    q, k_cache, v_cache, meta = make_batch(
        [1] * (num_seqs + 1),
        [max(c, 1) for c in context_lens],
        **heads(group),
        head_dim=32,
        block_size=16,
        dtype=torch.float32,
    )
    meta.context_lens[-1] = 0
    attention = decode.DecodeAttention(torch.device(DEVICE), dependent=False)
    assert decode.decode_splits(num_seqs + 1, 2, attention.num_sms) > 1
    expected = core.paged_attention_ref(q, k_cache, v_cache, meta, 32**-0.5)
    outs = [attention(q, k_cache, v_cache, meta, 32**-0.5) for _ in range(3)]
    for out in outs:
        assert_close(out, expected, ATOL[torch.float32], "merged in the kernel")
        assert torch.equal(out, outs[0]) and not out[-1].any()
    assert not attention.counters.any(), "a counter left non-zero"


@pytest.mark.gpu
@pytest.mark.usefixtures("nan_for_new_buffers")
@pytest.mark.parametrize(
    "dtype, group, head_dim, block_size, kv_dtype",
    [
        (torch.float32, 1, 64, 16, None),
        (torch.float16, 2, 128, 16, None),
        (torch.float32, 4, 32, 64, None),
        (torch.float16, 2, 64, 16, torch.float8_e4m3fn),  # an fp8 cache: the kernel's own keys per step
        pytest.param(
            torch.bfloat16, 2, 128, 16, None, marks=pytest.mark.skipif(not ON_GPU, reason="bf16 dots need a GPU")
        ),
    ],
)
def test_decode_attention_equals_the_reference_beside_prefill_chunks(dtype, group, head_dim, block_size, kv_dtype):
    """Guards against the extension's attention mishandling a mixed step (a prefill chunk's rows taken by the merge,
    or a decode's by the prefill kernel) or a batch big enough for one split (the core's one-split kernel, no
    merge): decodes alone, beside prefill chunks, and (decode-only) a batch of one split, each equal to the
    reference, over caches of the model's dtype and of fp8 (the kernel widens the fp8 values the reference widens)."""
    attention = decode.DecodeAttention(torch.device(DEVICE), dependent=False)
    one_split = -(-core.PROGRAMS_PER_SM * attention.num_sms // 2)  # sequences of 2 KV heads that fill a wave
    for query_lens in (
        [1] * randint(1, 4),
        [randint(2, 40), 1, 1, randint(2, 20), 1],
        [1] * one_split,
    ):
        context_lens = [q_len + randint(0, 300) for q_len in query_lens]
        batch = make_batch(
            query_lens,
            context_lens,
            **heads(group),
            head_dim=head_dim,
            block_size=block_size,
            dtype=dtype,
            kv_dtype=kv_dtype,
        )
        scale = head_dim**-0.5
        tolerance = ATOL.get(dtype, 2e-2)
        assert_close(attention(*batch, scale), core.paged_attention_ref(*batch, scale), tolerance, str(query_lens))
        assert not attention.counters.any()


@pytest.mark.parametrize("num_seqs", [1, 2, 8, 9, 33, 64, 65, 256])
def test_decode_splits_fill_one_wave_of_an_h100(num_seqs):
    """The extension's split rule, from the batch alone (a CUDA graph's grid): within MAX_SPLITS, the most splits whose
    grid fits one wave of an H100 (PROGRAMS_PER_SM programs on each of 132 SMs), never over it unless one split is
    (8 sequences of 8 KV heads: 8 splits, 512 programs, not the core's ceiling of 9 and 576), never a split fewer than
    fits; at most as many (sequence, KV head) pairs split as the counters hold."""
    num_kv_heads, h100_sms = 8, 132
    wave = core.PROGRAMS_PER_SM * h100_sms
    num_splits = decode.decode_splits(num_seqs, num_kv_heads, h100_sms)
    assert 1 <= num_splits <= decode.MAX_SPLITS
    programs = num_seqs * num_kv_heads * num_splits
    assert programs <= wave or num_splits == 1
    assert num_splits == decode.MAX_SPLITS or programs + num_seqs * num_kv_heads > wave  # one more would not fit
    assert num_splits == 1 or num_seqs * num_kv_heads <= wave  # the counters: one wave's worth
    if num_seqs == 8:
        assert num_splits == 8 < core.decode_splits(8, num_kv_heads, h100_sms)


def test_one_decode_variant_per_kind_of_grid(monkeypatch):
    """Guards against the merge kernel compiled in the middle of an eager run (0.5-1 s on a GPU): every batch that
    splits, whatever its size, split count or mix of prefills, presents one variant key to Triton (the engine's first
    graphs compile it), and a batch that fills the GPU goes to the core's one-split kernel (its own single variant,
    tests/test_attention.py), never to the merge."""
    from test_attention import triton_variant_key

    keys, one_split = set(), []
    merge = Recorder()
    monkeypatch.setattr(decode, "_decode_merge_kernel", merge)
    monkeypatch.setattr(decode, "prefill", lambda *args: None)
    monkeypatch.setattr(decode, "decode_split", lambda *args: one_split.append(args[5:]))
    attention = decode.DecodeAttention(torch.device(DEVICE), dependent=False)
    fills = -(-core.PROGRAMS_PER_SM * attention.num_sms // 2)
    splits = []
    for num_seqs in (1, 3, fills // 4, fills // 2, fills, fills + 3):
        for query_lens in ([1] * num_seqs, [randint(2, 20)] + [1] * (num_seqs - 1)):
            batch = make_batch(
                query_lens, [randint(20, 300)] * num_seqs, **heads(2), head_dim=32, block_size=16, dtype=torch.float16
            )
            launched = len(merge.launches)
            attention(*batch, 0.125)
            if len(merge.launches) > launched:
                key = tuple(map(triton_variant_key, merge.positional[-1]))
                keys.add(key + tuple(sorted(merge.launches[-1].items())))
        splits.append(decode.decode_splits(num_seqs, 2, attention.num_sms))
    assert 1 in splits and len(set(splits)) >= 4, splits
    # each batch size twice (decodes alone, and beside a prefill chunk): the merge for those that split
    assert len(keys) == 1 and len(merge.launches) == 2 * sum(n > 1 for n in splits)
    assert len(one_split) == 2 * splits.count(1) and all(n == 1 and out is not None for n, out in one_split)


# ---- the counters, stressed ------------------------------------------------------------------------------------------
GPU_LAUNCHES = 300  # eager launches on a GPU
GPU_GRAPH_LAUNCHES = 40  # launches captured in one graph
GPU_REPLAYS = 10  # replays of that graph
CPU_LAUNCHES = 4  # in the interpreter: one program at a time, so a few launches check the counters' reset only


def stressed_kernels():
    """(name, a launch, its counters) for every kernel that coordinates its programs through memory, at shapes with
    many splits: on a GPU, Qwen3-0.6B-like (a 4096 x 4096 bf16 projection in 8 splits, [gate | up] input; decode at
    1-8 sequences of 2k-8k keys, up to 32 splits); on a CPU, tiny ones."""
    device = torch.device(DEVICE)
    if ON_GPU:
        dtype, rows, out_features, in_features, split_k = torch.bfloat16, random.randint(1, 16), 4096, 4096, 8
        num_seqs, contexts, head_dim, group = randint(1, 8), (2048, 8192), 128, 2
    else:
        dtype, rows, out_features, in_features, split_k = torch.float32, random.randint(1, 16), 72, 512, 4
        num_seqs, contexts, head_dim, group = randint(1, 3), (20, 200), 32, 2
    x = torch.randn(rows, 2 * in_features, device=DEVICE).to(dtype)
    weight = (torch.randn(out_features, in_features, device=DEVICE) / in_features**0.5).to(dtype)
    workspace = G.Workspace(device)
    workspace.reserve(out_features, split_k)
    batch = make_batch(
        [1] * num_seqs,
        [randint(*contexts) for _ in range(num_seqs)],
        **heads(group, 8 if ON_GPU else 2),
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
    )
    attention = decode.DecodeAttention(device, G.dependent_launch(device))
    assert decode.decode_splits(num_seqs, batch[1].shape[2], attention.num_sms) > 1
    return [
        ("gemv", lambda: G.gemv(x, weight, None, split_k, workspace, True), workspace.counters),
        ("decode merge", lambda: attention(*batch, head_dim**-0.5), attention.counters),
    ]


@pytest.mark.gpu
def test_counters_hold_over_many_launches_in_and_out_of_a_graph():
    """Guards against a handshake that works once: a counter not reset (or reset before the last arrival), a merge by
    a program that arrived early, a partial read stale from L1, a dependent launch that reads before the kernel
    before has written, each of which may show only now and then. Every kernel that coordinates programs through
    memory (the GEMV's split-K counters, the decode merge's), launched many times on the same counters, eagerly and
    (where CUDA is) as replays of a graph of many launches: every output bitwise equal to the first launch's (the sums
    run in split order, so the bits do not depend on which program came last), the counters zero after each."""
    for name, launch, counters in stressed_kernels():
        first = launch()
        assert not counters.any(), f"{name}: a counter left non-zero by the first launch"
        for i in range(GPU_LAUNCHES if ON_GPU else CPU_LAUNCHES):
            assert torch.equal(launch(), first), f"{name}: launch {i + 1} differs from the first"
            assert not counters.any(), f"{name}: a counter left non-zero by launch {i + 1}"
        if not ON_GPU:
            continue
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [launch() for _ in range(GPU_GRAPH_LAUNCHES)]
        for replay in range(GPU_REPLAYS):
            for out in outs:
                out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            different = sum(not torch.equal(out, first) for out in outs)
            assert different == 0, f"{name}: replay {replay}: {different} of {len(outs)} launches differ"
            assert not counters.any(), f"{name}: a counter left non-zero by replay {replay}"


# ---- programmatic dependent launch -----------------------------------------------------------------------------------
@pytest.mark.parametrize("chosen", [True, False])
def test_a_dependent_launch_always_comes_with_its_wait(monkeypatch, chosen):
    """Guards against a programmatic dependent launch whose kernel does not wait (it would read its input before the
    kernel that writes it has finished), and against one asked for where the GPU has none: each kernel's launch_pdl
    and its DEPENDENT (its griddepcontrol.wait, built and ordered in the sm_90 build tests) are one choice, made once
    by the workspace: CUDA devices of sm_90 and later, never a CPU, never with DEPENDENT_LAUNCH off; the engine's
    decode attention takes the workspace's choice."""
    capability = {"capability": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability["capability"])
    assert G.dependent_launch(torch.device("cuda"))
    assert not G.dependent_launch(torch.device("cpu"))
    capability["capability"] = (8, 0)
    assert not G.dependent_launch(torch.device("cuda"))
    capability["capability"] = (10, 0)
    assert G.dependent_launch(torch.device("cuda"))
    monkeypatch.setattr(G, "DEPENDENT_LAUNCH", False)
    assert not G.dependent_launch(torch.device("cuda"))
    gemv_kernel, merge_kernel = Recorder(), Recorder()
    monkeypatch.setattr(G, "_gemv_kernel", gemv_kernel)
    monkeypatch.setattr(decode, "_decode_merge_kernel", merge_kernel)
    workspace = G.Workspace(torch.device("cpu"))
    assert workspace.dependent_launch is False
    workspace.dependent_launch = chosen
    workspace.reserve(64, 2)
    G.gemv(torch.randn(2, 256), torch.randn(64, 256), None, 2, workspace)
    batch = make_batch([1, 1], [30, 7], **heads(2), head_dim=32, block_size=16, dtype=torch.float32)
    decode.DecodeAttention(torch.device(DEVICE), workspace.dependent_launch)(*batch, 0.125)
    for kwargs in gemv_kernel.launches + merge_kernel.launches:
        assert kwargs["DEPENDENT"] is chosen and kwargs["launch_pdl"] is chosen


# ---- the engine ------------------------------------------------------------------------------------------------------
def forced_splits(split_k: int):
    """A stand-in for gemv.plan that splits every projection split_k ways: the tiny models' 64-128 inner features
    would never split by the plan's rule, and the engine's shared workspace and counters must see the handshake."""

    def plan(out_features: int, in_features: int, num_sms: int) -> int:
        return split_k

    return plan


@pytest.mark.parametrize(
    "kernels", ["torch", pytest.param("triton", marks=pytest.mark.gpu)]
)  # (the torch backend's run is the same on a GPU)
def test_engine_outputs_equal_transformers(tiny_model, monkeypatch, kernels):
    """Guards against the engine's use of the extension (a projection not wrapped, q|k|v split wrongly, the LM head's
    rows, a prefill of more than MAX_ROWS rows sent to the GEMV, projections of different tile counts sharing one
    workspace and one set of counters, SiLU-and-mul applied twice or never once it moves into the down projection,
    the decode attention's merge on a step's sequences): greedy tokens with the extension, every projection split 2
    ways, equal transformers', for Qwen2 (q|k|v with a bias); the three sequences stop after 8, 3 and 5 tokens, so
    decode steps of 3, 2 and 1 rows; every wrapped projection ran the GEMV, never on more than MAX_ROWS rows, and
    (triton) the decode steps ran the merge kernel. On a GPU, also with the decode graphs captured over the
    extension."""
    monkeypatch.setattr(G, "plan", forced_splits(2))
    path, hf = tiny_model("qwen2")
    prompts = random_prompts([21, 5, 9])
    lengths = [8, 3, 5]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    engine = ENGINE | {
        "kernels": kernels,
        "device": TRITON_DEVICE if kernels == "triton" else "cpu",
        "dtype": "float32",
    }
    expected = [hf_greedy(hf, p, n) for p, n in zip(prompts, lengths, strict=True)]
    if engine["device"] == "cuda":  # the decode graphs, captured over the wrapped projections and the merge
        graphed = LLM(path, **engine, latency_kernels=True).generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in graphed] == expected
    llm = LLM(path, **engine, latency_kernels=True, enforce_eager=True)
    state = llm.extensions["latency"]
    model = llm.runner.model
    wrapped = [m for m in model.modules() if isinstance(m, G.FewRowLinear)]
    assert wrapped == state.projections and len(wrapped) == 4 * len(model.model.layers) + 1
    assert {m.split_k for m in wrapped} == {2} and model.lm_head is wrapped[-1]
    assert model.kernels.silu_and_mul is latency.gate_and_up  # SiLU-and-mul moved into each down projection's load
    assert [m for m in wrapped if m.silu_and_mul is not None] == [layer.mlp.down_proj for layer in model.model.layers]
    if kernels == "triton":
        assert model.kernels.paged_attention is state.attention
        assert state.attention.dependent is state.workspace.dependent_launch
    else:
        assert state.attention is None and model.kernels.paged_attention is core.paged_attention_ref
    rows_seen = {id(m): [] for m in wrapped}
    for module in wrapped:
        real = module.gemv

        def counting(x, *args, module=module, real=real):
            rows_seen[id(module)].append(len(x))
            return real(x, *args)

        monkeypatch.setattr(module, "gemv", counting)
    merge = Recorder(decode._decode_merge_kernel)
    monkeypatch.setattr(decode, "_decode_merge_kernel", merge)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert all(rows_seen.values()), "a wrapped projection never took the GEMV"
    assert max(max(rows) for rows in rows_seen.values()) <= G.MAX_ROWS
    assert bool(merge.launches) == (kernels == "triton")
    assert not state.workspace.counters.any() and llm.stats()["kv_blocks_used"] == 0
    if kernels == "triton":
        assert not state.attention.counters.any()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU stand-in; the GPU engine test replays real graphs")
def test_decode_graphs_are_captured_over_the_extension(tiny_model, monkeypatch):
    """Guards against the CUDA-graph path's bugs on a CPU: graphs captured before the extension wired its projections
    and attention in (the engine captures once, after every extension's start), and counters or partials left over
    from one replay (or one graph size) spoiling the next. 'Capture' runs the forward eagerly and each replay reruns
    it on the static buffers, with the Triton kernels in the interpreter and every projection split 2 ways: 3
    sequences (a graph of 4, then smaller ones as they finish, the last steps one sequence alone) give transformers'
    greedy tokens, and every counter ends at zero."""
    monkeypatch.setattr(G, "plan", forced_splits(2))
    path, hf = tiny_model("qwen3")
    prompts = random_prompts([7, 19, 11])
    lengths = [2, 4, 7]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    engine = ENGINE | {"device": "cpu", "kernels": "triton", "dtype": "float32", "max_num_seqs": 4}
    captured = graphs_on_a_cpu(monkeypatch)
    llm = LLM(path, **engine, latency_kernels=True)
    graphs = llm.runner.graphs
    assert captured == [graphs]  # once, over the extension
    assert isinstance(graphs.model.model.layers[0].self_attn.qkv_proj, G.FewRowLinear)
    state = llm.extensions["latency"]
    assert graphs.model.kernels.paged_attention is state.attention
    graphs.graphs = {size: RerunGraph(graphs, size) for size in graphs.graphs}
    graphs.replays = 0
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [hf_greedy(hf, p, n) for p, n in zip(prompts, lengths, strict=True)]
    assert graphs.replays >= 5 and len(graphs.graphs) == 3  # sizes 1, 2 and 4
    assert not state.workspace.counters.any() and not state.attention.counters.any()
    assert llm.stats()["kv_blocks_used"] == 0


def test_lora_wraps_the_wrapped_projections(tiny_model, tmp_path):
    """Guards against LoRA losing its adapters (or q|k|v's shards) on projections the GEMV wrapped, and against
    SiLU-and-mul moved into the down projection under LoRA (its adapters read SiLU-and-mul's output): with both on,
    a request under an adapter gives the tokens it gives with LoRA alone, which differ from the base model's."""
    pytest.importorskip("safetensors")
    extension_or_skip("lora")
    from safetensors.torch import save_file

    from nanoserve.ext.lora import LoRARequest

    path, _ = tiny_model("qwen3")
    llm = LLM(path, **ENGINE, device="cpu", enable_lora=True, max_loras=2, latency_kernels=True)
    args, rank = llm.runner.model.args, 4
    # k of q|k|v, up of gate|up and down: a shard that is not the first of each merged projection, and the projection
    # whose input SiLU-and-mul makes
    sizes = {
        ("self_attn", "k_proj"): (args.hidden_size, args.num_kv_heads * args.head_dim),
        ("mlp", "up_proj"): (args.hidden_size, args.intermediate_size),
        ("mlp", "down_proj"): (args.intermediate_size, args.hidden_size),
    }
    tensors = {}
    for i in range(args.num_layers):
        for (part, name), (inner, outer) in sizes.items():
            prefix = f"base_model.model.model.layers.{i}.{part}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, inner) / 4
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(outer, rank) / 4
    folder = tmp_path / "adapter"
    folder.mkdir()
    config = {"r": rank, "target_modules": ["k_proj", "up_proj", "down_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, folder / "adapter_model.safetensors")
    adapter = LoRARequest("k-up-down", 1, str(folder))
    prompts = random_prompts([11, 6])
    both = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=adapter)]
    base = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    alone = LLM(path, **ENGINE, device="cpu", enable_lora=True, max_loras=2)
    lora_only = [o.outputs[0].token_ids for o in alone.generate(prompts, GREEDY, use_tqdm=False, lora_request=adapter)]
    assert both == lora_only != base
    assert llm.runner.model.kernels.silu_and_mul is not latency.gate_and_up
    assert all(m.silu_and_mul is None for m in llm.extensions["latency"].projections)


def test_bad_settings_are_refused_by_name():
    refused("latency_kernels", EngineConfig, device="cpu", latency_kernels=1)
    refused("latency_kernels", EngineConfig, device="cpu", latency_kernels=True, tensor_parallel_size=2)


def test_gemv_compiles_for_h100_without_spills():
    """Guards against a kernel that only Triton's interpreter accepts, and against the handshake losing its memory
    order: in bf16 and fp32, with one split, with four (and a bias), with four and SiLU-and-mul in its input load, the
    GEMV compiles for an H100 (sm_90) without spills, its weight tiles loaded ahead by 16-byte asynchronous copies
    (the software pipeline); with splits, a barrier lies between the stores and the counter's add, which is
    acquire-release at GPU scope, and the partials are read past L1; launched as a programmatic dependent (the only
    launch on sm_90), each program lets the next kernel start and prefetches its weight's first lines, and reads or
    writes nothing in global memory before its griddepcontrol.wait."""
    script = """
from nanoserve.ext.latency import gemv as G
for dtype in ("*bf16", "*fp32"):
    for split_k, bias, silu in ((1, False, False), (4, True, False), (4, False, True)):
        types = {name: dtype for name in ("x_ptr", "w_ptr", "bias_ptr", "y_ptr")}
        types |= {"partials_ptr": "*fp32", "counters_ptr": "*i32"}
        constants = {"HAS_BIAS": bias, "SILU_INPUT": silu, "SPLIT_K": split_k, "K_PER_SPLIT": 512,
                     "BLOCK_M": G.MAX_ROWS, "BLOCK_N": G.BLOCK_N, "BLOCK_K": G.BLOCK_K, "DEPENDENT": True,
                     "PREFETCH_LINES": G.PREFETCH_LINES}
        look_for = ("atom.global.gpu.acq_rel.add", "ld.global.cg", "griddepcontrol.launch_dependents",
                    "prefetch.global.L2")
        built = sm90_build.build(G._gemv_kernel, types, constants, G.NUM_WARPS, look_for, aligned=("N", "K"))
        print(json.dumps(built | {"split_k": split_k}))
"""
    builds = sm90_builds(script)
    assert len(builds) == 6, builds
    for b in builds:
        assert b["spill_bytes"] == 0 and 16 in b["async_copy_bytes"], b
        splits = b["split_k"] > 1
        assert b["acq_rel_atomics"] == splits and b["found"]["ld.global.cg"] == splits, b
        assert b["barrier_before_atomic"] == (True if splits else None), b
        # a programmatic dependent: it lets the next kernel start, prefetches, and touches nothing before its wait
        assert b["found"]["griddepcontrol.launch_dependents"] and b["found"]["prefetch.global.L2"], b
        assert b["waits_before_memory"] is True, b
