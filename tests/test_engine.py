"""The engine end to end on a tiny random model: chunked prefill, preemption and prefix caching must not
change greedy outputs; bad input fails early and leaves the engine usable; no block ever leaks."""

from functools import partial

import pytest
import torch
from conftest import RerunGraph, graphs_on_a_cpu, hf_greedy, random_prompts

import nanoserve
from nanoserve import SamplingParams

LLM = partial(nanoserve.LLM, device="cpu")  # CPU semantics in fp32 on any machine; GPU: test_gpu.py

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


def count_computed_tokens(llm):
    """Wraps the runner so a test can see how many tokens went through the model."""
    counter = {"tokens": 0}
    launch = llm.runner.launch

    def counting_launch(step, previous, processors):
        counter["tokens"] += step.num_tokens
        return launch(step, previous, processors)

    llm.runner.launch = counting_launch
    return counter


def test_chunked_prefill_matches_transformers(llama):
    """Guards against chunk boundaries that lose or repeat KV, and mixed prefill+decode batches."""
    path, hf = llama
    llm = LLM(path, max_model_len=256, num_kvcache_blocks=64, max_num_batched_tokens=16)
    prompts = random_prompts([5, 40, 23])
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 24) for p in prompts]


def test_preemption_under_small_pool_gives_same_outputs(llama):
    """Guards against preempted sequences resuming from the wrong place or losing generated tokens."""
    path, _ = llama
    prompts = random_prompts([30, 45, 20, 60, 35, 50, 25, 40])
    free = LLM(path, max_model_len=256, num_kvcache_blocks=128).generate(prompts, GREEDY, use_tqdm=False)
    # the batch needs about 8 x 4 = 32 blocks of 16 at its peak; give it 6 (enough for the longest alone)
    tight = LLM(path, max_model_len=256, num_kvcache_blocks=6)
    outs = tight.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in free]
    stats = tight.stats()
    assert stats["preemptions"] > 0 and stats["kv_blocks_used"] == 0
    # recomputing a preempted sequence is not a prefix-cache query: no hits on these distinct prompts
    assert stats["prefix_hit_tokens"] == 0 and all(o.num_cached_tokens == 0 for o in outs)


def test_prefix_cache_computes_only_uncached_tokens(llama):
    """Guards against prefix hits that are not used, or used with wrong KV."""
    path, hf = llama
    shared = random_prompts([64])[0]
    first = [shared + q for q in random_prompts([5, 9])]
    second = [shared + q for q in random_prompts([7, 11, 3])]
    llm = LLM(path, max_model_len=256, num_kvcache_blocks=64)
    llm.generate(first, GREEDY, use_tqdm=False)
    counter = count_computed_tokens(llm)
    outs = llm.generate(second, GREEDY, use_tqdm=False)
    uncached = sum(len(p) - 64 for p in second) + len(second) * (GREEDY.max_tokens - 1)
    assert counter["tokens"] == uncached
    assert all(o.num_cached_tokens == 64 for o in outs)
    off = LLM(path, max_model_len=256, num_kvcache_blocks=64, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in outs] == [
        o.outputs[0].token_ids for o in off.generate(second, GREEDY, use_tqdm=False)
    ]
    assert outs[0].outputs[0].token_ids == hf_greedy(hf, second[0], 24)


def test_repeated_prompt_fully_cached_still_samples(llama):
    """Guards against a fully cached prompt (a multiple of the block size) leaving nothing to compute."""
    path, _ = llama
    prompt = random_prompts([32])
    llm = LLM(path, max_model_len=256, num_kvcache_blocks=32)
    a = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    b = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and b.num_cached_tokens == 16


def test_max_model_len_ends_with_length(llama):
    """Guards against generating past max_model_len."""
    path, _ = llama
    llm = LLM(path, max_model_len=40, num_kvcache_blocks=16)
    out = llm.generate(
        random_prompts([30]), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False
    )[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 10


def test_stop_token_ids_eos_and_min_tokens(llama):
    """Guards against ignoring stop ids / EOS, and against stopping before min_tokens."""
    path, _ = llama
    llm = LLM(path, max_model_len=256, num_kvcache_blocks=32)
    prompt = random_prompts([12])
    free = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_id = free[5]
    # the model's own EOS ignored: a random prompt's greedy tokens may hold it before the stop id
    stop_only = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id], ignore_eos=True)
    out = llm.generate(prompt, stop_only, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids == free[: free.index(stop_id) + 1]
    llm.eos_token_ids = frozenset({stop_id})  # the same token as the model's EOS
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert out.outputs[0].token_ids[-1] == stop_id and out.outputs[0].finish_reason == "stop"
    late = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, min_tokens=10), use_tqdm=False)[0]
    assert len(late.outputs[0].token_ids) > 10 and stop_id not in late.outputs[0].token_ids[:10]


def test_seed_reproducible_whatever_the_batch(llama):
    """Guards against a seeded request's samples depending on its batch neighbours or on preemption."""
    path, _ = llama
    p = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=1234)
    prompts = random_prompts([10, 25, 33])
    alone = LLM(path, max_model_len=256, num_kvcache_blocks=64).generate(prompts[:1], p, use_tqdm=False)[0]
    tight = LLM(path, max_model_len=256, num_kvcache_blocks=4)
    batched = tight.generate(prompts, [p, GREEDY, SamplingParams(temperature=0.8, max_tokens=20)], use_tqdm=False)
    assert batched[0].outputs[0].token_ids == alone.outputs[0].token_ids
    other = tight.generate(
        prompts[:1], SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=99), use_tqdm=False
    )[0]
    assert other.outputs[0].token_ids != alone.outputs[0].token_ids


BAD_PARAMS = [
    {"temperature": -0.1},
    {"top_p": 0.0},
    {"top_p": 1.5},
    {"top_k": 0},
    {"top_k": -2},
    {"min_p": -0.1},
    {"min_p": 1.5},
    {"max_tokens": 0},
    {"min_tokens": 5, "max_tokens": 4},
]


@pytest.mark.parametrize("kwargs", BAD_PARAMS, ids=lambda k: ",".join(k))
def test_bad_sampling_params_name_the_field(kwargs):
    """Guards against out-of-range sampling settings being silently accepted."""
    field = "min_tokens" if "min_tokens" in kwargs else next(iter(kwargs))
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_requests_raise_before_work_and_engine_stays_usable(llama):
    """Guards against half-admitted requests leaking blocks or wedging the engine after an error."""
    path, hf = llama
    with pytest.raises(ValueError, match="max_num_sequences: unknown keyword: EngineConfig has no such field"):
        LLM(path, max_num_sequences=4)
    with pytest.raises(ValueError, match="kvcache_block_size"):
        LLM(path, kvcache_block_size=24)
    llm = LLM(path, max_model_len=64, num_kvcache_blocks=8)
    good = random_prompts([10])[0]
    bad = {"empty": [], "lie in": [5, 400], "max_model_len": list(range(3, 70))}
    for match, prompt in bad.items():
        with pytest.raises(ValueError, match=match):
            llm.generate([good, prompt], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="KV blocks"):  # 8 blocks of 16 can never hold 200 tokens
        LLM(path, max_model_len=256, num_kvcache_blocks=8).generate(
            [good], SamplingParams(max_tokens=190), use_tqdm=False
        )
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([good, good], [GREEDY], use_tqdm=False)
    with pytest.raises(ValueError, match="integer token ids"):
        llm.generate([[5.5, 7.0]], GREEDY, use_tqdm=False)
    for bad_params, field in [
        (SamplingParams(stop_token_ids=[10**6], min_tokens=2), "stop_token_ids"),
        (SamplingParams(stop_token_ids=[-1]), "stop_token_ids"),
        (SamplingParams(logprobs=10**6), "logprobs"),
    ]:
        with pytest.raises(ValueError, match=field):
            llm.generate([good], bad_params, use_tqdm=False)
    huge_seed = SamplingParams(temperature=1.0, max_tokens=4, seed=2**80, ignore_eos=True)  # any int seed is fine
    assert len(llm.generate([good], huge_seed, use_tqdm=False)[0].outputs[0].token_ids) == 4
    assert llm.stats()["kv_blocks_used"] == 0 and not llm.scheduler.has_unfinished()
    assert llm.generate([good], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(hf, good, 24)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_triton_kernels_in_the_engine_match_transformers(tiny_model, family):
    """Guards against kernel bugs that only show in the engine's real metadata (chunked prefill, prefix
    hits, mixed batches). On CPU the kernels run in Triton's interpreter."""
    path, hf = tiny_model(family)
    llm = nanoserve.LLM(
        path, kernels="triton", dtype="float32", max_model_len=128, num_kvcache_blocks=32, max_num_batched_tokens=24
    )  # on the GPU when there is one
    shared = random_prompts([20])[0]
    prompts = [shared + q for q in random_prompts([4, 13])] + random_prompts([30])
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # caches `shared`
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert llm.stats()["prefix_hit_tokens"] > 0
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in prompts]


def test_gpu_start_up_steps_run_before_the_cache_exists(llama, monkeypatch):
    """Guards against start-up order bugs that only a GPU would hit: there warm_up compiles every prefill tile and
    runs the biggest step (which needs the sampler) before the KV cache is sized. CPU skips it, so force it."""
    from nanoserve.model_runner import ModelRunner

    path, hf = llama
    warmed = []

    def blocks_after_warm_up(runner):
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
        runner.warm_up()
        warmed.append(True)
        return 32

    monkeypatch.setattr(ModelRunner, "blocks_from_memory", blocks_after_warm_up)
    llm = nanoserve.LLM(
        path,
        kernels="triton",
        dtype="float32",
        max_model_len=128,  # the GPU if there is one
        max_num_batched_tokens=64,
        max_num_seqs=4,
    )
    assert warmed and llm.runner.num_kvcache_blocks == 32
    prompt = random_prompts([11])[0]
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(hf, prompt, 24)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU stand-in; test_gpu.py replays real graphs")
def test_decode_through_graph_buffers_matches_transformers(llama, monkeypatch):
    """Guards against the CUDA-graph path's own bugs (stale or unpadded static inputs, the decode grid sized
    for max_model_len) on a CPU: 'capture' runs eagerly, and replay reruns the forward on the static buffers."""
    from nanoserve import attention

    path, hf = llama
    splits_seen = set()  # the decode grid's splits in the replays: one split (no reduce) and several, both
    decode_splits = attention.decode_splits

    def recording_splits(*args):
        splits_seen.add(decode_splits(*args))
        return decode_splits(*args)

    monkeypatch.setattr(attention, "decode_splits", recording_splits)
    captured = graphs_on_a_cpu(monkeypatch)
    llm = nanoserve.LLM(
        path, device="cpu", kernels="triton", dtype="float32", max_model_len=128, num_kvcache_blocks=64, max_num_seqs=8
    )
    graphs = llm.runner.graphs
    assert captured == [graphs] and sorted(graphs.graphs) == [1, 2, 4, 8]
    graphs.graphs = {size: RerunGraph(graphs, size) for size in graphs.graphs}
    graphs.replays = 0
    prompts = random_prompts([5, 12, 30, 7, 21])  # 5 sequences: the graph of 8, three rows padded...
    lengths = [10, 3, 7, 5, 9]  # ...then 4, 3, 2 and 1 rows as they finish: graphs of 4, 2 and 1
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert graphs.replays >= 9
    # with 2 KV heads and the interpreter's 4 SMs, the graph of 8 gets one split and the smaller ones several
    assert 1 in splits_seen and max(splits_seen) > 1
    assert [o.outputs[0].token_ids for o in outs] == [
        hf_greedy(hf, p, n) for p, n in zip(prompts, lengths, strict=False)
    ]


def test_an_engine_dropped_is_freed_at_once_without_the_collector(llama):
    """Guards against reference cycles through the engine: an engine caught in one waits for a full collection (or,
    in a server whose heap is frozen after start-up, forever) before its pool, weights and workers are freed. An engine
    that served requests, streaming and not, must go by reference counting alone."""
    import gc
    import weakref

    path, _ = llama
    llm = LLM(path, max_model_len=256, num_kvcache_blocks=64)
    llm.generate(random_prompts([5, 9]), GREEDY, use_tqdm=False)
    request_id = llm.add_request(random_prompts([4])[0], GREEDY, stream=True)
    while llm.has_unfinished_requests():
        llm.step()
    assert request_id not in llm.requests
    engine, runner = weakref.ref(llm), weakref.ref(llm.runner)
    gc.disable()
    try:
        del llm
        assert engine() is None and runner() is None
    finally:
        gc.enable()
