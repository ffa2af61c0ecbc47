"""Parallel sampling, SamplingParams(n=N) (nanoserve/ext/parallel_sampling.py): the N samples compute the prompt once
(the others take its blocks from the prefix cache); greedy samples all equal transformers; seeded samples differ from
each other, and each equals a single request with its derived seed (so every sample is reproducible on its own); the
engine's seed stands in for a request's missing one; only the first sample computes prompt logprobs; and n beyond
max_num_seqs is refused by name with the engine left serving."""

import pytest
from conftest import FakeEngine, hf_greedy, random_prompts, reference_completion, refused

from nanoserve import LLM, SamplingParams

parallel_sampling = pytest.importorskip("nanoserve.ext.parallel_sampling")

ENGINE = {"device": "cpu", "max_model_len": 128, "num_kvcache_blocks": 32, "max_num_seqs": 8}


def test_n_samples_compute_the_prompt_once():
    """Guards against SamplingParams(n=4) computing its prompt four times: the first sample computes it, the
    others take every full block of it from the prefix cache and compute only the last partial block."""
    engine = FakeEngine(block_size=4, max_num_batched_tokens=256)
    prompt = list(range(1, 31))  # 30 tokens: 7 full blocks of 4, then 2 tokens
    request_id = engine.llm.add_request(prompt, SamplingParams(max_tokens=6, ignore_eos=True, n=4))
    seqs = engine.llm.requests[request_id].seqs
    engine.run()
    cached = (len(prompt) - 1) // 4 * 4
    assert [s.num_cached_tokens for s in seqs] == [0, cached, cached, cached]
    prompt_work = sum(engine.tokens_computed(s) - (6 - 1) for s in seqs)  # minus each sample's decodes
    assert prompt_work == len(prompt) + 3 * (len(prompt) - cached)
    assert all(s.completion_token_ids == reference_completion(prompt, 6) for s in seqs)  # the fake is greedy


@pytest.fixture(scope="module")
def llama(tiny_model):
    path, hf = tiny_model("llama")
    return LLM(path, **ENGINE), hf


def test_greedy_samples_all_equal_transformers(llama):
    """Guards against the added samples running with other parameters or another prompt than the first."""
    llm, hf = llama
    prompt = random_prompts([9])[0]
    out = llm.generate(prompt, SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(o.token_ids == hf_greedy(hf, prompt, 8) for o in out.outputs)
    assert llm.stats()["kv_blocks_used"] == 0


def test_seeded_samples_differ_and_each_is_reproducible_alone(llama):
    """Guards against n seeded samples drawing the same noise (n copies of one sample), and against a sample whose
    draws depend on its siblings: sample i equals a single request with sample i's derived seed."""
    llm, _ = llama
    prompt = random_prompts([6])[0]
    params = SamplingParams(n=4, temperature=1.5, max_tokens=12, ignore_eos=True, seed=1234)
    together = [o.token_ids for o in llm.generate(prompt, params, use_tqdm=False)[0].outputs]
    assert len({tuple(t) for t in together}) == 4, together
    for index, tokens in enumerate(together):
        seed = params.seed if index == 0 else parallel_sampling.sample_params(params, index).seed
        single = SamplingParams(temperature=1.5, max_tokens=12, ignore_eos=True, seed=seed)
        assert llm.generate(prompt, single, use_tqdm=False)[0].outputs[0].token_ids == tokens, index


def test_the_engine_seed_makes_unseeded_samples_reproducible(tiny_model):
    """Guards against LLM(seed=...) reaching only the first sample: two engines with one seed give the same n
    samples, different from each other."""
    path, _ = tiny_model("llama")
    prompt = random_prompts([6])[0]
    params = SamplingParams(n=3, temperature=1.5, max_tokens=10, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(path, seed=99, **ENGINE)
        runs.append([o.token_ids for o in llm.generate(prompt, params, use_tqdm=False)[0].outputs])
    assert runs[0] == runs[1] and len({tuple(t) for t in runs[0]}) == 3


def test_only_the_first_sample_computes_prompt_logprobs(llama):
    """Guards against every sample recomputing the prompt for its logprobs (prompt logprobs keep a sequence off the
    prefix cache): the output has them once, and the other samples take the prompt's blocks from the cache."""
    llm, _ = llama
    prompt = random_prompts([40])[0]  # two full blocks of 16 and a partial one
    params = SamplingParams(n=3, temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    request_id = llm.add_request(prompt, params, stream=False)
    seqs = llm.requests[request_id].seqs
    assert [s.params.prompt_logprobs for s in seqs] == [2, None, None]
    outputs = []
    while llm.has_unfinished_requests():
        outputs += llm.step()
    (out,) = outputs
    assert [s.num_cached_tokens for s in seqs] == [0, 32, 32]
    # the one list is the single-sample request's (itself checked against transformers: tests/test_prompt_logprobs.py)
    single = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert out.prompt_logprobs == single.prompt_logprobs and out.prompt_logprobs[0] is None


def test_more_samples_than_a_step_runs_are_refused(llama):
    """Guards against n > max_num_seqs being queued: its samples could never all run in one step."""
    llm, hf = llama
    prompt = random_prompts([5])[0]
    refused("n", llm.generate, prompt, SamplingParams(n=9), use_tqdm=False)
    refused("n", llm.add_request, prompt, SamplingParams(n=10**6))
    assert not llm.has_unfinished_requests() and llm.stats()["kv_blocks_used"] == 0
    out = llm.generate(prompt, SamplingParams(n=8, temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert all(o.token_ids == hf_greedy(hf, prompt, 3) for o in out.outputs)
