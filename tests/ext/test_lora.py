"""Multi-LoRA serving (nanoserve/ext/lora/): greedy outputs and logprobs equal to PEFT's model (transformers + peft,
unmerged, fp32) on tiny random Llama, Qwen2 and Qwen3 bases with random adapters of different ranks and targets; a
batch that mixes adapters and plain rows equal, row by row, to each request alone, also under preemption in a small
pool, chunked prefill and prefix caching (blocks never shared across adapters); the SGMV kernel against its PyTorch
reference, and that against a plain gather-and-bmm, on random shapes; more adapters in flight than slots (hypothesis
over request orders: every request finishes with its own output, no step holds more adapters than slots, nothing
leaks); bad input refused by name before any work; vLLM's names; the server's --lora-modules."""

import itertools
import json
import random
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    TRITON_DEVICE,
    RerunGraph,
    extension_or_skip,
    graphs_on_a_cpu,
    hf_greedy_run,
    random_prompts,
    refused,
    sm90_builds,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

lora = extension_or_skip("lora")
peft = pytest.importorskip("peft")
from transformers import AutoModelForCausalLM  # noqa: E402

from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.ext.chat import chat_prompts  # noqa: E402
from nanoserve.ext.lora import LoRAConfig, LoRARequest  # noqa: E402
from nanoserve.ext.lora.kernels import sgmv, sgmv_ref  # noqa: E402

ENGINE = {"device": "cpu", "max_model_len": 128, "num_kvcache_blocks": 64, "enable_lora": True, "max_loras": 4}
# name -> (rank, target modules, more of PEFT's LoraConfig): ranks 2 to 16, attention only, MLP only, one projection
# of a merged one (k of q|k|v, up of gate|up), all of them, rsLoRA's scaling
ADAPTERS = {
    "qv8": (8, ["q_proj", "v_proj"], {}),
    "kogd4": (4, ["k_proj", "o_proj", "gate_proj", "down_proj"], {"use_rslora": True}),
    "all16": (16, "all-linear", {"lora_alpha": 32}),  # PEFT saves its modules' paths
    "up2": (2, ["up_proj"], {"lora_alpha": 7}),
}
NUM_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    """adapters(family) -> (base model's folder, {name: LoRARequest}): PEFT adapters with random A and B (PEFT's
    init_lora_weights=False; its default leaves B zero, which would change nothing), saved as PEFT saves them."""
    made = {}

    def make(family: str):
        if family not in made:
            path, _ = tiny_model(family)
            folder = tmp_path_factory.mktemp(f"{family}-adapters")
            requests = {}
            for lora_int_id, (name, (rank, targets, more)) in enumerate(ADAPTERS.items(), 1):
                torch.manual_seed(lora_int_id)
                config = peft.LoraConfig(r=rank, target_modules=targets, init_lora_weights=False, **more)
                peft.get_peft_model(AutoModelForCausalLM.from_pretrained(path), config).save_pretrained(folder / name)
                requests[name] = LoRARequest(name, lora_int_id, str(folder / name))
            made[family] = (path, requests)
        return made[family]

    return make


def peft_model(base_path: str, adapter: LoRARequest | None):
    """transformers' model with PEFT's adapter on top, unmerged, fp32 (the base alone for None)."""
    base = AutoModelForCausalLM.from_pretrained(base_path).eval()
    return base if adapter is None else peft.PeftModel.from_pretrained(base, adapter.lora_path).eval()


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_greedy_and_logprobs_equal_peft(adapters, family):
    """Guards against an adapter applied to the wrong shard of a merged projection (q|k|v, gate|up), the wrong rows,
    the wrong scale (alpha / r, rsLoRA's alpha / sqrt(r)), ranks padded wrongly, or a row taking another row's adapter:
    one batch of every adapter and a plain row must give PEFT's greedy tokens and top-5 logprobs, row by row."""
    path, requests = adapters(family)
    torch.manual_seed(0)
    prompts = random_prompts([9, 21, 14, 30, 6])
    per_prompt = [*requests.values(), None]
    llm = LLM(path, **ENGINE, max_lora_rank=16)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)
    for prompt, adapter, out in zip(prompts, per_prompt, outs, strict=True):
        theirs, top = hf_greedy_run(peft_model(path, adapter), prompt, NUM_TOKENS)
        assert out.outputs[0].token_ids == theirs, adapter
        for ours, expected in zip(out.outputs[0].logprobs, top, strict=True):
            for token, logprob in expected.items():
                assert ours[token] == pytest.approx(logprob, abs=1e-4), adapter
    assert llm.stats()["kv_blocks_used"] == 0


def test_adapters_change_the_output(adapters):
    """Guards against a test suite that passes with adapters silently ignored: each adapter's greedy output differs
    from the base model's on some prompt."""
    path, requests = adapters("llama")
    torch.manual_seed(1)
    prompts = random_prompts([12, 17, 25])
    llm = LLM(path, **ENGINE)
    base = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    for adapter in requests.values():
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=adapter)) != base, adapter


def alone(llm: LLM, prompts: list, per_prompt: list) -> list[list[int]]:
    """Each prompt's greedy tokens when it runs by itself, under its own adapter."""
    return [
        tokens(llm.generate([p], GREEDY, use_tqdm=False, lora_request=[a]))[0]
        for p, a in zip(prompts, per_prompt, strict=True)
    ]


def test_a_mixed_batch_equals_each_request_alone(adapters):
    """Guards against rows of one step mixing up their adapters (three adapters and plain rows, interleaved, two
    requests per adapter): each row equals its request run alone."""
    path, requests = adapters("qwen3")
    torch.manual_seed(2)
    prompts = random_prompts([7, 19, 11, 24, 5, 16, 9])
    qv8, kogd4, all16 = requests["qv8"], requests["kogd4"], requests["all16"]
    per_prompt = [qv8, None, kogd4, all16, qv8, None, all16]
    llm = LLM(path, **ENGINE)
    together = tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=per_prompt))
    assert together == alone(llm, prompts, per_prompt)
    assert llm.stats()["kv_blocks_used"] == 0


def test_the_triton_kernel_serves_a_mixed_batch_as_the_reference_does(adapters):
    """Guards against the SGMV kernel's path through the engine (the launcher's strides and shapes as the layers give
    them, the shard axis of q|k|v, the step's segments) differing from its reference's: a mixed batch, in Triton's
    interpreter, gives the reference engine's tokens (which the tests above check against PEFT)."""
    path, requests = adapters("qwen2")
    torch.manual_seed(7)
    prompts = random_prompts([7, 19, 11, 5])
    per_prompt = [requests["qv8"], None, requests["kogd4"], requests["all16"]]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    runs = [
        tokens(LLM(path, **engine).generate(prompts, params, use_tqdm=False, lora_request=per_prompt))
        for engine in (ENGINE | {"kernels": "triton", "device": TRITON_DEVICE, "dtype": "float32"}, ENGINE)
    ]
    assert runs[0] == runs[1]


def record_steps(llm: LLM) -> list[list[tuple]]:
    """Per step (after ext/lora's own hook): each scheduled sequence's (adapter, block table, start, tokens)."""
    steps = []
    llm.runner.step_hooks.append(
        lambda step: steps.append(
            [(s.seq.cache_salt, list(s.seq.block_table), s.start, s.num_new_tokens) for s in step.scheduled]
        )
    )
    return steps


def test_preemption_chunked_prefill_and_prefix_caching_keep_adapters_apart(adapters):
    """Guards against the adapter being lost or swapped where preemption, recompute, chunked prefill and the prefix
    cache meet: in a pool too small for the batch (preemptions), with 8-token chunks, requests with one prompt under
    two adapters and none never hold the same block at once (a shared block would give one the other's K/V), and
    every output equals its request alone."""
    path, requests = adapters("llama")
    torch.manual_seed(3)
    shared = random_prompts([40])[0]  # two full blocks of 16, then a partial one
    prompts = [shared, shared, shared, shared, *random_prompts([30, 12])]
    qv8, all16 = requests["qv8"], requests["all16"]
    per_prompt = [qv8, all16, None, qv8, all16, None]
    small = dict(ENGINE, num_kvcache_blocks=9, max_num_batched_tokens=8)
    llm = LLM(path, **small)
    steps = record_steps(llm)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=per_prompt)
    assert llm.stats()["preemptions"] > 0 and llm.stats()["kv_blocks_used"] == 0
    assert max(len(step) for step in steps) > 1 and all(n <= 8 for step in steps for *_, n in step)
    for step in steps:  # blocks held at once by sequences under different adapters are different blocks
        for (a, table_a, *_), (b, table_b, *_) in itertools.combinations(step, 2):
            assert a == b or not set(table_a) & set(table_b), (a, b, table_a, table_b)
    assert tokens(outs) == alone(LLM(path, **ENGINE), prompts, per_prompt)


def test_the_prefix_cache_finds_blocks_under_their_own_adapter_only(adapters):
    """Guards against a prefix-cache key without the adapter: one prompt, run after itself under another adapter or
    none, finds nothing cached; under its own adapter again it finds its full blocks."""
    path, requests = adapters("qwen2")
    torch.manual_seed(4)
    prompt = random_prompts([50])[0]  # three full blocks
    llm = LLM(path, **ENGINE)

    def cached(adapter: LoRARequest | None) -> int:
        return llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=adapter)[0].num_cached_tokens

    assert cached(requests["qv8"]) == 0
    assert cached(requests["up2"]) == 0 and cached(None) == 0
    assert cached(requests["qv8"]) == cached(requests["up2"]) == cached(None) == 48


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_replay_any_mix_of_adapters(adapters):
    """Guards against decode graphs captured without the adapters (the engine's start must capture them again over the
    wrapped projections), a replay that reads the previous step's segments or slots, padded rows that take an adapter,
    and slot replacement racing the steps in flight (overlap is on): on a GPU, in fp32 with the Triton kernels and CUDA
    graphs, 5 rows (a graph of 8) under 4 adapters and none, then the same prompts under 3 adapters with 2 slots (they
    queue, and slots are replaced between steps), give PEFT's greedy tokens."""
    path, requests = adapters("qwen3")
    torch.manual_seed(8)
    prompts = random_prompts([7, 19, 11, 24, 5])
    qv8, kogd4, all16, up2 = requests.values()
    gpu = {"dtype": "float32", "max_model_len": 128, "num_kvcache_blocks": 64, "max_num_seqs": 8}
    for max_loras, per_prompt in ((4, [qv8, None, kogd4, all16, up2]), (2, [qv8, kogd4, all16, qv8, None])):
        llm = LLM(path, **gpu, enable_lora=True, max_loras=max_loras)
        assert llm.runner.graphs is not None and llm.config.overlap
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=per_prompt)
        for prompt, adapter, out in zip(prompts, per_prompt, outs, strict=True):
            assert out.outputs[0].token_ids == hf_greedy_run(peft_model(path, adapter), prompt, NUM_TOKENS)[0]
        assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU stand-in; the GPU test replays real graphs")
def test_decode_graphs_are_captured_once_over_the_adapters_and_read_the_current_step(adapters, monkeypatch):
    """Guards against the CUDA-graph path's LoRA bugs on a CPU: graphs captured before the projections were wrapped
    (the engine captures them once, after every extension's start: over the adapters), replays that read a stale
    step's segments or slots (they are static buffers, filled before each replay), and padded rows that take an
    adapter.
    'Capture' runs the forward eagerly and each replay reruns it on the static buffers; 5 rows (a graph of 8) under 3
    adapters and none, with 2 slots (so slots are replaced between steps), give the eager engine's tokens."""
    from nanoserve.ext.lora import LoRALinear

    path, requests = adapters("qwen3")
    torch.manual_seed(9)
    prompts = random_prompts([7, 19, 11, 24, 5])
    per_prompt = [requests["qv8"], requests["kogd4"], None, requests["all16"], requests["qv8"]]
    engine = dict(ENGINE, max_loras=2, max_num_seqs=8)
    eager = tokens(LLM(path, **engine).generate(prompts, GREEDY, use_tqdm=False, lora_request=per_prompt))
    captured = graphs_on_a_cpu(monkeypatch)
    llm = LLM(path, **engine)
    graphs = llm.runner.graphs
    assert len(captured) == 1 and graphs is captured[0]  # once, after the extensions' start
    assert isinstance(graphs.model.model.layers[0].self_attn.qkv_proj, LoRALinear)
    graphs.graphs = {size: RerunGraph(graphs, size) for size in graphs.graphs}
    graphs.replays = 0
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=per_prompt)) == eager
    assert graphs.replays >= NUM_TOKENS - 1 and llm.stats()["kv_blocks_used"] == 0


# ---- the kernel -----------------------------------------------------------------------------------------------------
def random_step(num_rows: int, num_slots: int, seed: int) -> tuple[list[int | None], list[list[int]]]:
    """Each row's slot or None (no adapter), at random with holes (slots with no rows), and the rows of each slot."""
    generator = torch.Generator().manual_seed(seed)
    slot_of = [None if s == num_slots else s for s in torch.randint(0, num_slots + 1, (num_rows,), generator=generator)]
    slot_of = [None if s is not None and s % 3 == 1 else s for s in slot_of]  # slot 1 (and 4, ...) gets no rows
    return slot_of, [[r for r, s in enumerate(slot_of) if s == slot] for slot in range(num_slots)]


def segments_of(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """rows_by_slot (with spare entries past the segments, as the engine's buffer has) and slot_starts."""
    starts = torch.tensor([0, *itertools.accumulate(map(len, rows))], dtype=torch.int32)
    return torch.tensor([*itertools.chain(*rows), 0, 0, 0], dtype=torch.int32), starts


def gather_bmm(x, a, b, slot_of, ranks, scales, shard_sizes):
    """The brief's reference: each row gathers its slot's A and B and multiplies them (bmm), shard by shard; None for a
    row with no adapter or whose slot's rank is 0."""
    rank = b.shape[2]
    out = []
    for row, slot in enumerate(slot_of):
        if slot is None or ranks[slot] == 0:
            out.append(None)
            continue
        u = x[row].float() @ a[slot].float().T  # [shards x rank]
        pieces = [
            u[i * rank : (i + 1) * rank].to(b.dtype).float() @ b[slot, start : start + n].float().T
            for i, (start, n) in enumerate(zip(itertools.accumulate([0, *shard_sizes]), shard_sizes, strict=False))
        ]
        out.append(torch.cat(pieces) * scales[slot])
    return out


CASES = [  # (rows, in features, shard sizes, max rank, slots, dtype)
    (1, 64, (64,), 1, 1, torch.float32),
    (5, 70, (40, 24, 24), 7, 3, torch.float32),
    (40, 96, (96, 96), 16, 4, torch.float32),
    (33, 128, (64, 32, 32), 64, 5, torch.float32),
    (17, 64, (80,), 16, 2, torch.float16),
    (24, 48, (32, 16, 16), 8, 6, torch.float16),
]


@pytest.mark.parametrize("num_rows, in_features, shard_sizes, max_rank, num_slots, dtype", CASES)
def test_sgmv_kernel_equals_its_reference(num_rows, in_features, shard_sizes, max_rank, num_slots, dtype):
    """Guards against the kernel reading another slot's weights, writing rows of another segment or of no adapter,
    crossing shard boundaries, or mishandling ranks 1-64, slots with no rows, a slot whose rank here is 0, and tiles
    cut by the segments' ends: on random shapes in Triton's interpreter, the shrink and the expand equal the PyTorch
    reference, which equals a per-row gather-and-bmm; rows of no adapter are left exactly as they were."""
    torch.manual_seed(num_rows)
    slot_of, rows = random_step(num_rows, num_slots, seed=num_rows)
    rows_by_slot, slot_starts = segments_of(rows)
    ranks = torch.randint(1, max_rank + 1, (num_slots,), dtype=torch.int32)
    ranks[-1] = 0 if num_slots > 2 else ranks[-1]  # the last slot's adapter leaves this projection alone
    x = torch.randn(num_rows, in_features).to(dtype)
    a = (torch.randn(num_slots, len(shard_sizes) * max_rank, in_features) / in_features**0.5).to(dtype)
    b = torch.randn(num_slots, sum(shard_sizes), max_rank).to(dtype)
    for slot, rank in enumerate(ranks.tolist()):  # padded to max rank with zeros, as the slots are
        a[slot].view(len(shard_sizes), max_rank, in_features)[:, rank:] = 0
        b[slot, :, rank:] = 0
    scales = torch.rand(num_slots) + 0.5
    col_starts = torch.tensor([0, *itertools.accumulate(shard_sizes)], dtype=torch.int32)
    segments = (rows_by_slot, slot_starts, ranks)
    u_kernel, u_ref = (torch.full((num_rows, a.shape[1]), float("nan")) for _ in range(2))
    sgmv(u_kernel, x, a, *segments)
    sgmv_ref(u_ref, x, a, *segments)
    y = torch.randn(num_rows, sum(shard_sizes)).to(dtype)
    y_kernel, y_ref = y.clone(), y.clone()
    sgmv(y_kernel, u_ref, b, *segments, scales, col_starts)
    sgmv_ref(y_ref, u_ref, b, *segments, scales, col_starts)
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}
    expected = gather_bmm(x, a, b, slot_of, ranks.tolist(), scales, shard_sizes)
    for row, delta in enumerate(expected):
        if delta is None:  # no adapter here: untouched, bit for bit (the shrink leaves it unset)
            assert torch.equal(y_kernel[row], y[row]) and torch.equal(y_ref[row], y[row])
            continue
        torch.testing.assert_close(u_kernel[row], u_ref[row], **tolerance)
        torch.testing.assert_close(y_ref[row].float(), y[row].float() + delta, **tolerance)
        torch.testing.assert_close(y_kernel[row].float(), y_ref[row].float(), **tolerance)


@pytest.mark.parametrize("draw", range(4))
def test_sgmv_kernel_on_freshly_drawn_shapes(draw):
    """The same comparison on shapes drawn afresh each run (the seed is in the failure's message, to replay it):
    1-48 rows, 16-160 input features, 1-3 shards of 8-96 columns, a max rank up to 64 (64 in the first draw), 1-8
    slots, fp32 or fp16."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    max_rank = 64 if draw == 0 else rng.randint(1, 64)
    shards = tuple(rng.randint(8, 96) for _ in range(rng.randint(1, 3)))
    shape = (rng.randint(1, 48), rng.randint(16, 160), shards, max_rank, rng.randint(1, 8))
    dtype = rng.choice([torch.float32, torch.float16])
    try:
        test_sgmv_kernel_equals_its_reference(*shape, dtype)
    except AssertionError as error:
        raise AssertionError(f"seed {seed}: rows, features, shards, max rank, slots = {shape}, {dtype}") from error


def test_sgmv_kernel_compiles_for_h100_without_spills():
    """Guards against a kernel that only Triton's interpreter accepts: the shrink and the expand, in every model
    dtype, compile for an H100 (sm_90) with ptxas, with no register spills (tests/sm90_build.py's build)."""
    script = """
from nanoserve.ext.lora import kernels as K
for dtype in ("*bf16", "*fp16", "*fp32"):
    for expand, tile_k in ((False, 64), (True, 16), (True, 64)):
        types = {"x_ptr": "*fp32" if expand else dtype, "w_ptr": dtype, "out_ptr": dtype if expand else "*fp32",
                 "rows_ptr": "*i32", "slot_starts_ptr": "*i32", "ranks_ptr": "*i32"}
        constants = {"TILE_M": K.TILE_M, "TILE_N": K.TILE_N, "TILE_K": tile_k, "EXPAND": expand}
        if expand:
            types |= {"scales_ptr": "*fp32", "col_starts_ptr": "*i32"}
        else:
            constants |= {"scales_ptr": None, "col_starts_ptr": None}
        print(json.dumps(sm90_build.build(K._sgmv_kernel, types, constants, 4) | {"expand": expand}))
"""
    builds = sm90_builds(script)
    assert len(builds) == 9 and all(b["spill_bytes"] == 0 for b in builds), builds


# ---- slots: more adapters in flight than max_loras ---------------------------------------------------------------
@pytest.fixture(scope="module")
def slots_engine(adapters):
    """One engine for every example: 2 slots and 2 adapters on the host for 4 adapters (both evict), and each request's
    output alone (computed once, on an engine with a slot for each adapter)."""
    path, requests = adapters("llama")
    torch.manual_seed(5)
    prompts = random_prompts([6, 13, 9, 20])
    choices = [*requests.values(), None]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    roomy = LLM(path, **ENGINE)
    expected = {
        (p, a): tokens(roomy.generate([prompts[p]], params, use_tqdm=False, lora_request=[choices[a]]))[0]
        for p in range(len(prompts))
        for a in range(len(choices))
    }
    llm = LLM(path, **dict(ENGINE, max_loras=2, max_cpu_loras=2, num_kvcache_blocks=12, max_num_batched_tokens=24))
    steps = record_steps(llm)
    return llm, prompts, choices, params, expected, steps


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 4), st.integers(0, 6)),  # (prompt, adapter or none, arrival step)
        min_size=1,
        max_size=8,
    )
)
def test_more_adapters_than_slots_queue_and_finish(slots_engine, requests):
    """Guards against a step that needs more adapters than there are slots (a row would read another adapter's
    weights), a slot replaced while a step still needs it, an adapter dropped from the host and not read again, a
    request that never finishes (the queue held for ever), or leaked blocks: requests arrive at random steps, under
    4 adapters and none with 2 slots and 2 adapters on the host; each gets its output alone."""
    llm, prompts, choices, params, expected, steps = slots_engine
    steps.clear()
    ids, outputs = {}, {}
    last_arrival = max(arrival for *_, arrival in requests)
    for step in itertools.count():
        for n, (prompt, adapter, arrival) in enumerate(requests):
            if arrival == step:
                ids[n] = lora.add_request(llm, prompts[prompt], params, stream=False, lora_request=choices[adapter])
        outputs |= {out.request_id: out for out in llm.step()}
        if step >= last_arrival and not llm.has_unfinished_requests():
            break
        assert step < 500, "the requests never finished"
    for n, (prompt, adapter, _) in enumerate(requests):
        assert outputs[ids[n]].outputs[0].token_ids == expected[prompt, adapter], (n, requests)
    for scheduled in steps:  # no step held more adapters than slots
        assert len({adapter for adapter, *_ in scheduled} - {None}) <= 2
    assert llm.stats()["kv_blocks_used"] == 0 and not llm.scheduler.running and not llm.scheduler.waiting
    assert len(llm.extensions["lora"].slot_of) == 2  # every slot back (free, or an adapter no sequence uses)
    lora.check_adapter(llm, choices[0])  # the host keeps max_cpu_loras adapters once none is in use
    assert len(llm.extensions["lora"].host.works) <= 2


# ---- settings and bad input -----------------------------------------------------------------------------------------
def test_vllm_names_and_lora_config(tiny_model):
    """Guards against vLLM's LoRA options being dropped or half-read: enable_lora with max_loras, max_lora_rank and
    max_cpu_loras makes the LoRAConfig nanoserve's lora_config option makes, a dict or JSON text of it too."""
    sizes = {"max_loras": 3, "max_lora_rank": 32, "max_cpu_loras": 5}
    path = tiny_model("llama")[0]
    vllm_style = LLM(path, device="cpu", max_model_len=64, num_kvcache_blocks=8, enable_lora=True, **sizes)
    assert vllm_style.config.lora_config == LoRAConfig(**sizes)
    for given_config in (LoRAConfig(max_loras=2), {"max_loras": 2}, '{"max_loras": 2}'):
        llm = LLM(path, device="cpu", max_model_len=64, num_kvcache_blocks=8, lora_config=given_config)
        assert llm.config.lora_config == LoRAConfig(2, 16, 2) and len(llm.extensions["lora"].layers) == 4 * 2


def write_adapter(folder: Path, config: dict, tensors: dict) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    from safetensors.torch import save_file

    save_file(tensors, folder / "adapter_model.safetensors")
    return str(folder)


def test_bad_input_is_refused_by_name_before_any_work(adapters, tiny_model, tmp_path):
    """Guards against a bad adapter or LoRA setting failing in the middle of a step (or not at all): an unknown or
    unreadable adapter, a rank above max_lora_rank, target modules the model lacks, DoRA, an adapter made for another
    base (its shapes), lora_request without LoRA on, a list of the wrong length, a bad lora_config, max_loras without
    enable_lora, and tensor parallelism are InvalidFields naming the field, before any request is queued; the engine
    serves on and nothing leaks."""
    path, requests = adapters("llama")
    prompt = random_prompts([8])[0]
    plain = LLM(path, device="cpu", max_model_len=128, num_kvcache_blocks=16)
    refused("lora_request", plain.generate, prompt, GREEDY, use_tqdm=False, lora_request=requests["qv8"])
    llm = LLM(path, **ENGINE, max_lora_rank=4)
    qv8 = requests["qv8"]
    a_proj = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    b_proj = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    peft_config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    good = {a_proj: torch.zeros(4, 64), b_proj: torch.zeros(64, 4)}
    bad = {
        "missing": LoRARequest("missing", 9, str(tmp_path / "nowhere")),
        "rank above max_lora_rank": qv8,  # rank 8 > 4
        "target module the model lacks": LoRARequest(
            "gpt2", 10, write_adapter(tmp_path / "gpt2", {**peft_config, "target_modules": ["c_attn"]}, good)
        ),
        "DoRA": LoRARequest("dora", 11, write_adapter(tmp_path / "dora", {**peft_config, "use_dora": True}, good)),
        "another base": LoRARequest(
            "wide",
            12,
            write_adapter(tmp_path / "wide", peft_config, {a_proj: torch.zeros(4, 96), b_proj: good[b_proj]}),
        ),
        "a layer the model lacks": LoRARequest(
            "deep", 13, write_adapter(tmp_path / "deep", peft_config, {a_proj.replace("s.0.", "s.7."): good[a_proj]})
        ),
        "not a LoRARequest": ("qv8", 1, qv8.lora_path),
    }
    for case, lora_request in bad.items():
        error = refused("lora_request", llm.generate, [prompt], GREEDY, use_tqdm=False, lora_request=[lora_request])
        assert error.problem, case
    refused("lora_request", llm.generate, [prompt, prompt], GREEDY, use_tqdm=False, lora_request=[None])
    refused("lora_request", LoRARequest, "x", 0, "path")  # vLLM's ids are positive
    assert llm.stats()["kv_blocks_used"] == 0 and not llm.scheduler.waiting and not llm.requests
    ok = LoRARequest("ok", 14, write_adapter(tmp_path / "ok", peft_config, good))
    assert tokens(llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=ok)) == tokens(
        llm.generate([prompt], GREEDY, use_tqdm=False)
    )  # a zero adapter changes nothing
    engine = {"device": "cpu", "max_model_len": 64}
    refused("lora_config", LLM, path, **engine, lora_config={"max_lora": 2})
    refused("lora_config", LLM, path, **engine, lora_config="{max_loras: 2}")
    refused("max_lora_rank", LLM, path, **engine, lora_config={"max_lora_rank": 512})
    refused("max_cpu_loras", LLM, path, **engine, enable_lora=True, max_loras=4, max_cpu_loras=2)
    refused("max_loras", LLM, path, **engine, max_loras=4)
    refused("enable_lora", LLM, path, **engine, enable_lora=True, lora_config={})
    refused("tensor_parallel_size", LLM, path, **engine, enable_lora=True, tensor_parallel_size=2)


# ---- the server -----------------------------------------------------------------------------------------------------
def test_the_server_serves_adapters_by_model_name(tmp_path):
    """Guards against --lora-modules being ignored: /v1/models lists the base model and each adapter, a request whose
    model names an adapter gets what LLM.generate gives under it, an unknown model is a 404, and the pool empties."""
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from conftest import default_model_or_skip

    from nanoserve.ext.server.app import ServerConfig, serve_in_background

    model_dir = default_model_or_skip()
    torch.manual_seed(6)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    peft.get_peft_model(base, config).save_pretrained(tmp_path / "shouty")
    llm = LLM(model_dir, max_model_len=256, num_kvcache_blocks=64, enable_lora=True)
    prompt = "The capital of France is"
    expected = llm.generate(
        prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("shouty", 1, str(tmp_path / "shouty"))
    )
    plain = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].text
    with serve_in_background(llm, ServerConfig(lora_modules=[f"shouty={tmp_path / 'shouty'}"])) as url:
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)
        models = client.models.list().data
        assert [m.id for m in models][1:] == ["shouty"] and models[1].parent == models[0].id
        body = {"prompt": prompt, "temperature": 0, "max_tokens": NUM_TOKENS, "extra_body": {"ignore_eos": True}}
        answer = client.completions.create(model="shouty", **body)
        assert answer.choices[0].text == expected[0].outputs[0].text != plain and answer.model == "shouty"
        assert client.completions.create(model=models[0].id, **body).choices[0].text == plain
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nobody", **body)
    assert llm.stats()["kv_blocks_used"] == 0


def test_the_servers_lora_flags_are_vllms(monkeypatch):
    """Guards against a vLLM user's command line failing: `--enable-lora --max-loras 4 --max-lora-rank 32` reach LLM()
    as vLLM's names (which ext/vllm_names.py turns into lora_config), --lora-modules alone turns LoRA on with vLLM's
    sizes, and a module that is not name=path is refused by that flag's name before any model is loaded."""
    pytest.importorskip("fastapi")
    from nanoserve.ext.server import app as server

    engines = []

    class Stop(Exception):
        pass

    def made(**kwargs):
        engines.append(kwargs)
        raise Stop

    monkeypatch.setattr(server, "LLM", made)
    for argv, expected in (
        (["--enable-lora", "--max-loras", "4", "--max-lora-rank", "32"], {"enable_lora": True, "max_loras": 4}),
        (["--lora-modules", "a=/x", "b=/y"], {"lora_config": "{}"}),
        (["--enable-lora", "--lora-modules", "a=/x"], {"enable_lora": True}),
    ):
        with pytest.raises(Stop):
            server.main(argv)
        assert engines[-1].items() >= expected.items(), engines[-1]
    assert engines[0]["max_lora_rank"] == 32 and "lora_config" not in engines[2]
    for module in ("shouty", "=/x", "a="):
        refused("lora_modules", server.main, ["--lora-modules", module])
    assert len(engines) == 3  # no engine made for a bad module


def test_bench_loras_mode(tmp_path):
    """Guards against bench.py --loras (the BENCHMARKS figure and gpu_check.sh's) crashing or reporting runs that are
    not the same requests: the no-adapter run and the adapters' generate the same tokens and say how much slower."""
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))
    import bench

    tiny = ["--arch", "tiny", "--num-seqs", "4", "--max-input-len", "40", "--max-output-len", "8"]
    bench.main([*tiny, "--max-model-len", "1024", "--loras", "2", "--json", str(tmp_path / "rows.json")])
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [row["run"] for row in rows] == ["no adapter", "2 adapters"]
    assert rows[0]["output_tokens"] == rows[1]["output_tokens"] == 4 * 8 and rows[1]["lora_slowdown"] > 0


def test_chat_takes_lora_request(adapters):
    """Guards against LLM.chat dropping vLLM's lora_request: a chat under an adapter equals generate under it on the
    template's prompt, and differs from the plain chat (the tiny model has no tokenizer: a stand-in template)."""

    class Template:
        chat_template = "a stand-in"

        @staticmethod
        def apply_chat_template(conversations: list, **kwargs: object) -> list[list[int]]:
            return [[5 + len(message["content"]) for message in conversation] * 4 for conversation in conversations]

    path, requests = adapters("llama")
    llm = LLM(path, **ENGINE)
    llm.tokenizer = Template()
    chat = [{"role": "user", "content": "Hello there"}]
    under = tokens(llm.chat(chat, GREEDY, use_tqdm=False, lora_request=requests["all16"]))
    assert under == tokens(
        llm.generate(chat_prompts(llm, chat), GREEDY, use_tqdm=False, lora_request=requests["all16"])
    )
    assert under != tokens(llm.chat(chat, GREEDY, use_tqdm=False))


# ---- what an adapter brings is checked before it is used (issue 44) ------------------------------------------------
def test_adapter_values_that_would_make_wrong_output_are_refused_by_name(adapters, tiny_model, tmp_path):
    """Guards against an adapter that is accepted and then fails inside a step or silently ruins the output (a
    lora_alpha of 1e300 overflowed the slot's fp32 scale mid-step and kept the slot; NaN or inf weights made every
    token id 0): a scale that is not a finite float32, a weight that is not finite, and weights whose worst case
    overflows the model's dtype (the overflow rule: fine in fp32, too large in fp16) are each an InvalidField naming
    lora_request before any request is queued; the engine serves on and a good adapter still works."""
    path, requests = adapters("llama")
    prompt = random_prompts([8])[0]
    llm = LLM(path, **ENGINE)
    a_proj = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    b_proj = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    peft_config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    weights = {a_proj: torch.randn(4, 64) * 0.1, b_proj: torch.randn(64, 4) * 0.1}
    nan = {a_proj: weights[a_proj].clone(), b_proj: weights[b_proj]}
    nan[a_proj][2, 5] = float("nan")
    inf = {a_proj: weights[a_proj], b_proj: weights[b_proj].clone()}
    inf[b_proj][7, 1] = float("inf")
    bad = {
        "alpha 1e300": ({**peft_config, "lora_alpha": 1e300}, weights),
        "alpha nan": ({**peft_config, "lora_alpha": float("nan")}, weights),
        "alpha a string": ({**peft_config, "lora_alpha": "8"}, weights),
        "a nan weight": (peft_config, nan),
        "an inf weight": (peft_config, inf),
        "a weight beyond fp32": (peft_config, {a_proj: weights[a_proj].double() * 1e300, b_proj: weights[b_proj]}),
        "not an object": ([1, 2], weights),
    }
    for n, (case, (config, tensors)) in enumerate(bad.items()):
        adapter = LoRARequest(case, 100 + n, write_adapter(tmp_path / str(n), config, tensors))
        error = refused("lora_request", llm.generate, [prompt], GREEDY, use_tqdm=False, lora_request=adapter)
        assert error.problem, case
    assert llm.stats()["kv_blocks_used"] == 0 and not llm.requests and not llm.scheduler.waiting
    large = {a_proj: torch.ones(4, 64), b_proj: torch.ones(64, 4)}  # worst case 256 x 64 x (1 + 2 x 4) = 147,456
    fine_in_fp32 = LoRARequest("large", 200, write_adapter(tmp_path / "large", peft_config, large))
    assert len(llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=fine_in_fp32)[0].outputs[0].token_ids) == 10
    fp16 = LLM(path, **ENGINE, dtype="float16")
    refused("lora_request", fp16.generate, [prompt], GREEDY, use_tqdm=False, lora_request=fine_in_fp32)
    assert fp16.generate([prompt], GREEDY, use_tqdm=False, lora_request=requests["qv8"])[0].outputs[0].token_ids


def test_lora_requests_and_sizes_are_refused_by_name_at_once(tiny_model):
    """Guards against LoRARequest taking ids that are no int64 (True, 2**70) and max_loras=10**9 allocating for 25 s
    before failing in the allocator: each is an InvalidField naming the field, raised before anything is made."""
    refused("lora_request", LoRARequest, "x", True, "path")
    refused("lora_request", LoRARequest, "x", 2**70, "path")
    refused("lora_request", LoRARequest, "x", 1, None)
    start = time.perf_counter()
    refused("max_loras", LLM, tiny_model("llama")[0], device="cpu", enable_lora=True, max_loras=10**9)
    refused("max_loras", LoRAConfig, max_loras=lora.MAX_LORAS + 1)
    assert time.perf_counter() - start < 5


def test_beam_search_under_an_adapter_equals_peft(adapters):
    """Guards against beam_search(..., lora_request=...) being a TypeError, or its beams (forks of a sequence) losing
    the adapter: each prompt's beams under an adapter are transformers' beam search on PEFT's model (fp32, greedy
    beams, length_penalty 1); a list of adapters is refused by name (one adapter for the search)."""
    from nanoserve.sampling_params import BeamSearchParams

    path, requests = adapters("llama")
    torch.manual_seed(12)
    prompts = random_prompts([6, 11])
    llm = LLM(path, **ENGINE)
    k, max_tokens = 2, 6
    outs = llm.beam_search(prompts, BeamSearchParams(k, max_tokens, ignore_eos=True), lora_request=requests["all16"])
    hf = peft_model(path, requests["all16"])
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt])
        theirs = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            num_beams=k,
            num_return_sequences=k,
            max_new_tokens=max_tokens,
            do_sample=False,
            early_stopping=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert [s.tokens for s in out.sequences] == theirs.tolist()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    refused("lora_request", llm.beam_search, prompts, BeamSearchParams(k, 4), lora_request=[requests["qv8"]] * 2)
