"""What a vLLM user types first works on nanoserve: the seed's example as written for vLLM, vLLM's names for engine
arguments (block_size, seed, tokenizer, trust_remote_code, disable_log_stats), its other engine arguments refused as
vLLM options nanoserve does not implement (not as unknown), RequestOutput.metrics in wall-clock time with
time_in_queue and first_scheduled_time, and what comes next: LLM.get_tokenizer(), SamplingParams' truncate_prompt_tokens
and detokenize, and any other keyword refused by name. (vLLM's prompt dicts are its names' extension's:
tests/ext/test_vllm_names.py.) Every refusal is an InvalidField naming the field, made before any
weight is read, and no block leaks."""

import dataclasses
import time

import pytest
from conftest import default_model_or_skip, hf_greedy, random_prompts

import nanoserve.model_runner
from nanoserve import LLM, SamplingParams
from nanoserve.sampling_params import InvalidField

ENGINE = {"device": "cpu", "max_model_len": 64, "num_kvcache_blocks": 16}
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def refused(field: str, make: object, *args: object, **kwargs: object) -> str:
    """make(*args, **kwargs) raises an InvalidField for field; returns its message."""
    with pytest.raises(InvalidField) as info:
        make(*args, **kwargs)
    assert info.value.field == field, info.value
    return info.value.problem


@pytest.fixture
def no_weights_loaded(monkeypatch):
    """Fails the test if an LLM gets as far as loading weights: the check must come first."""

    def fail(*args: object) -> None:
        raise AssertionError("the weights were loaded before the arguments were checked")

    monkeypatch.setattr(nanoserve.model_runner, "build_model", fail)


@pytest.fixture(scope="module")
def with_tokenizer(tiny_model):
    """The tiny llama (weights only) with the default model's tokenizer (tokenizer=), and its transformers twin."""
    path, hf = tiny_model("llama")
    return LLM(path, tokenizer=default_model_or_skip(), **ENGINE), hf


def test_the_seeds_vllm_example_runs_unchanged():
    """Guards against the first vLLM program people copy failing on nanoserve (it used to raise TypeError on
    repetition_penalty): vLLM's LLM(...) and SamplingParams(...) arguments, output.prompt, .outputs[0].text and
    .metrics, with the default model (its max_position_embeddings is 8192, so max_model_len=8192 is its limit)."""
    model = default_model_or_skip()
    llm = LLM(model=model, dtype="auto", max_model_len=8192, gpu_memory_utilization=0.9, tensor_parallel_size=1)
    sampling_params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=1024, repetition_penalty=1.1)
    prompts = ["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"]
    llm.runner.sampler.fresh_seeds.seed(1)  # not in the example: a draw that ends at EOS soon, to keep the test fast
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        assert output.prompt == prompts[0] and output.outputs[0].text.strip()
        assert output.metrics.arrival_time <= output.metrics.first_token_time <= output.metrics.finished_time
    assert llm.stats()["kv_blocks_used"] == 0


def test_vllm_engine_names(tiny_model, with_tokenizer):
    """Guards against vLLM's names refused as unknown: block_size (kvcache_block_size's alias, not both at once),
    trust_remote_code=False and disable_log_stats are taken; tokenizer= loads a tokenizer from another folder."""
    path, hf = tiny_model("llama")
    llm = LLM(path, block_size=32, trust_remote_code=False, disable_log_stats=True, **ENGINE)
    assert llm.config.kvcache_block_size == 32 and llm.block_manager.block_size == 32
    prompt = random_prompts([9])[0]
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(hf, prompt, 6)
    llm, _ = with_tokenizer
    # the random weights may favour a special id (SmolLM2's 0-16, whose text is skipped): ban them, so the text is
    # never empty by luck and the check is on the tokenizer's decoding
    specials = [i for i, token in llm.tokenizer.added_tokens_decoder.items() if token.special]
    no_specials = SamplingParams(temperature=0, max_tokens=6, logit_bias=dict.fromkeys(specials, -100))
    out = llm.generate(prompt, no_specials, use_tqdm=False)[0].outputs[0]
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True) and out.text
    assert llm.stats()["kv_blocks_used"] == 0


def test_bad_vllm_arguments_are_refused_by_name(tiny_model, tmp_path, no_weights_loaded):
    """Guards against an unknown option (a misspelt one) being taken silently, and against a tokenizer folder with no
    tokenizer, or a bad seed, getting as far as loading the weights. vLLM's own names for options nanoserve does not
    have are their extension's tests (tests/ext/test_vllm_names.py)."""
    path, _ = tiny_model("llama")
    assert "unknown" in refused("quantisation", LLM, path, quantisation="awq", **ENGINE)
    refused("tokenizer", LLM, path, tokenizer=tmp_path, **ENGINE)
    refused("tokenizer", LLM, path, tokenizer=5, **ENGINE)
    refused("seed", LLM, path, seed=1.5, **ENGINE)
    refused("seed", LLM, path, seed=True, **ENGINE)


def test_metrics_are_wall_clock_with_time_in_queue(tiny_model):
    """Guards against perf_counter() readings in RequestOutput.metrics (vLLM's are time.time()) and a missing or
    wrong time_in_queue / first_scheduled_time: with one sequence at a time, the second request waits in the queue
    until the first has finished."""
    path, _ = tiny_model("llama")
    llm = LLM(path, max_num_seqs=1, **ENGINE)
    before = time.time()
    first, second = llm.generate(random_prompts([5, 6]), GREEDY, use_tqdm=False)
    after = time.time()
    for out in (first, second):
        m = out.metrics
        assert before <= m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time <= after
        assert m.time_in_queue == m.first_scheduled_time - m.arrival_time
    assert second.metrics.first_scheduled_time >= first.metrics.finished_time
    assert second.metrics.time_in_queue > first.metrics.time_in_queue
    assert llm.stats()["kv_blocks_used"] == 0


def test_get_tokenizer_and_unknown_sampling_keywords(with_tokenizer):
    """Guards against LLM.get_tokenizer() missing (vLLM's accessor) and against a SamplingParams keyword that is no
    field (a misspelling, or one of vLLM's that nanoserve lacks) failing with a bare TypeError: an InvalidField names
    it. copy.deepcopy (Sequence.fork), dataclasses.replace and pickle still make SamplingParams."""
    import copy
    import pickle

    llm, _ = with_tokenizer
    assert llm.get_tokenizer() is llm.tokenizer and llm.get_tokenizer().encode("hi")
    assert "unknown" in refused("output_kind", SamplingParams, temperature=0, output_kind=1)
    assert "unknown" in refused("temprature", SamplingParams, temprature=0.5)
    refused("a", SamplingParams, b=1, a=2)  # the first in order, whatever the set's
    params = SamplingParams(temperature=0.5, stop=["x"], seed=3)
    for made in (copy.deepcopy(params), pickle.loads(pickle.dumps(params)), dataclasses.replace(params)):
        assert made == params and made is not params
    assert dataclasses.replace(params, max_tokens=5).max_tokens == 5


def test_truncate_prompt_tokens_keeps_the_last_ones(tiny_model):
    """Guards against truncate_prompt_tokens cutting the wrong end (vLLM keeps the last N) or being applied after the
    length check (a prompt longer than max_model_len, truncated, must be served): the output equals transformers' on
    the prompt's last N tokens."""
    path, hf = tiny_model("llama")
    llm = LLM(path, **ENGINE)
    prompt = random_prompts([80])[0]  # longer than max_model_len (64)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, truncate_prompt_tokens=9))
    assert out[0].prompt_token_ids == prompt[-9:]
    assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt[-9:], 6)
    short = llm.generate(prompt[:5], SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=9))[0]
    assert short.prompt_token_ids == prompt[:5]  # shorter than N: kept whole
    for bad in (0, -1, 1.5, True):
        refused("truncate_prompt_tokens", SamplingParams, truncate_prompt_tokens=bad)
    assert llm.stats()["kv_blocks_used"] == 0


def test_detokenize_false_gives_ids_without_text(with_tokenizer):
    """Guards against detokenize=False still decoding (or changing the tokens): the same token ids, no text and no
    text deltas, streamed or not; stop strings, which are matched in the text, are refused with it, as vLLM does."""
    llm, _ = with_tokenizer
    prompt = random_prompts([6])[0]
    # Special tokens' text kept: a random model may answer only special tokens (ids 0-16 here), whose text is
    # otherwise empty, and the plain run must have text for the comparison to mean anything.
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, skip_special_tokens=False)
    expected = llm.generate(prompt, plain, use_tqdm=False)[0].outputs[0]
    assert expected.text, "the plain run has text"
    quiet = dataclasses.replace(plain, detokenize=False)
    out = llm.generate(prompt, quiet, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected.token_ids and out.text == ""
    llm.add_request(prompt, quiet, "streamed")
    deltas = []
    while llm.has_unfinished_requests():
        deltas += [o.outputs[0].text_delta for o in llm.step()]
    assert deltas and set(deltas) == {""}
    refused("stop", SamplingParams, stop=["x"], detokenize=False)
    refused("detokenize", SamplingParams, detokenize="no")


def test_huge_counts_and_unreadable_tensors_are_refused_by_name(tiny_model, no_weights_loaded):
    """Guards against LLM(max_num_seqs=10**9) reaching an allocation sized by it (a MemoryError), and against token
    ids given as a sparse or meta-device tensor raising torch's RuntimeError or NotImplementedError."""
    import torch

    path, _ = tiny_model("llama")
    refused("max_num_seqs", LLM, path, max_num_seqs=10**9, **ENGINE)
    ids = torch.tensor([5, 6, 7])
    for unreadable in (ids.to_sparse(), torch.empty(3, dtype=torch.long, device="meta")):
        refused("stop_token_ids", SamplingParams, stop_token_ids=unreadable)
    assert SamplingParams(stop_token_ids=ids).stop_token_ids == [5, 6, 7]  # a dense tensor is fine


@pytest.mark.parametrize("kind", ["sparse", "meta"])
def test_unreadable_tensors_are_refused_as_prompts_and_token_lists(tiny_model, kind):
    """The same for the other places that take token ids: a prompt (generate and add_request) and allowed_token_ids
    name their field, and the engine serves the next request."""
    import torch

    path, _ = tiny_model("llama")
    dense = torch.tensor([5, 6, 7])
    unreadable = dense.to_sparse() if kind == "sparse" else torch.empty(3, dtype=torch.long, device="meta")
    llm = LLM(path, **ENGINE)
    refused("prompt", llm.generate, unreadable, use_tqdm=False)
    refused("prompt", llm.add_request, unreadable)
    refused("allowed_token_ids", SamplingParams, allowed_token_ids=unreadable)
    assert llm.generate(dense, SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
