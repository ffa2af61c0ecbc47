"""The prompt-logprobs extension (nanoserve/ext/prompt_logprobs.py): prompt_logprobs=N against transformers'
log-softmax over the prompt, on the tiny random models in fp32: per prompt
position, the top N tokens' logprobs and the actual token's, the first position None. They are computed from the
logits of the rows before each prompt token, across chunked-prefill chunks, never from a prefix-cache hit (which
has no logits), once per position even when a preempted request recomputes its prompt."""

from functools import partial

import pytest
import torch
from conftest import extension_or_skip, random_prompts

extension_or_skip("prompt_logprobs")

import nanoserve  # noqa: E402
from nanoserve import SamplingParams  # noqa: E402
from nanoserve.sampling_params import InvalidField  # noqa: E402

LLM = partial(nanoserve.LLM, device="cpu", max_model_len=128)  # CPU semantics in fp32 on any machine
TOLERANCE = 1e-4  # fp32 rounding: the engine's kernels sum in another order than transformers'


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


def expected_prompt_logprobs(hf, prompt: list[int], n: int) -> list[dict[int, float] | None]:
    """transformers' answer: entry i from the log-softmax of the logits at position i - 1."""
    with torch.no_grad():
        logprobs = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)  # [len(prompt), vocab]
    expected = [None]
    for i in range(1, len(prompt)):
        top = logprobs[i - 1].topk(n)
        entry = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        entry[prompt[i]] = logprobs[i - 1, prompt[i]].item()
        expected.append(entry)
    return expected


def assert_prompt_logprobs_match(hf, prompt: list[int], got: list, n: int) -> None:
    expected = expected_prompt_logprobs(hf, prompt, n)
    assert len(got) == len(prompt) and got[0] is None
    for position, (entry, want) in enumerate(zip(got[1:], expected[1:], strict=True), start=1):
        assert entry.keys() == want.keys(), f"position {position}"
        assert max(abs(entry[t] - want[t]) for t in want) < TOLERANCE, f"position {position}"


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_prompt_logprobs_match_transformers_across_chunks(tiny_model, family, overlap):
    """Guards against logprobs from the wrong row (off by one, or another sequence's), a chunk's last row not giving
    the next chunk's first token, and rows lost or repeated where chunks meet; prompts batched with plain requests
    and with different N."""
    path, hf = tiny_model(family)
    llm = LLM(path, num_kvcache_blocks=32, max_num_batched_tokens=16, max_num_seqs=4, overlap=overlap)
    prompts = random_prompts([40, 7, 23, 2])  # 40 and 23: split over several steps of 16 tokens
    params = [
        SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3),
        SamplingParams(temperature=0, max_tokens=3),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1, logprobs=2),
        SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=5),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[1].prompt_logprobs is None
    for out, prompt, p in zip(outs, prompts, params, strict=True):
        if p.prompt_logprobs is not None:
            assert_prompt_logprobs_match(hf, prompt, out.prompt_logprobs, p.prompt_logprobs)
    assert len(outs[2].outputs[0].logprobs) == 3  # sampled logprobs beside them, as before
    assert llm.stats()["kv_blocks_used"] == 0


def test_prompt_logprobs_0_gives_only_the_actual_token(llama):
    """Guards against N = 0 returning top tokens, or dropping the actual token's logprob."""
    path, hf = llama
    llm = LLM(path, num_kvcache_blocks=16)
    prompt = random_prompts([12])[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=0), use_tqdm=False)[0]
    assert [list(entry) for entry in out.prompt_logprobs[1:]] == [[t] for t in prompt[1:]]
    assert_prompt_logprobs_match(hf, prompt, out.prompt_logprobs, 0)


def test_no_prefix_hits_yet_its_blocks_serve_others(llama):
    """Guards against a request with prompt_logprobs taking a cached prefix (those tokens would have no logits, and
    their entries would be missing or stale), and against its own blocks not being cached for others."""
    path, hf = llama
    llm = LLM(path, num_kvcache_blocks=32, max_num_batched_tokens=32)
    shared = random_prompts([48])[0]
    first, asking, after = (shared + tail for tail in random_prompts([5, 9, 4]))
    llm.generate([first], SamplingParams(max_tokens=2), use_tqdm=False)  # caches the 48 shared tokens
    out = llm.generate([asking], SamplingParams(max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert_prompt_logprobs_match(hf, asking, out.prompt_logprobs, 2)
    llm.block_manager.cached.clear()  # forget `first`'s blocks: only those `asking` computed can serve `after`
    llm.generate([asking], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    assert llm.generate([after], SamplingParams(max_tokens=2), use_tqdm=False)[0].num_cached_tokens == 48
    assert llm.stats()["kv_blocks_used"] == 0


def test_preemption_records_each_position_once(llama):
    """Guards against a preempted request, which recomputes its prompt, losing entries or recording them twice. (With
    n > 1, one list for all samples: tests/ext/test_parallel_sampling.py.)"""
    path, hf = llama
    prompts = random_prompts([40, 35, 45, 30])
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=2)
    llm = LLM(path, num_kvcache_blocks=5, max_num_batched_tokens=24)  # 5 blocks of 16: room for one at a time
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["preemptions"] > 0
    for out, prompt in zip(outs, prompts, strict=True):
        assert_prompt_logprobs_match(hf, prompt, out.prompt_logprobs, 2)
    assert llm.stats()["kv_blocks_used"] == 0


def test_prompt_rows_in_slices(llama):
    """Guards against the slicing that bounds the logits' memory (max_num_seqs rows at a time) losing or reordering
    rows: a 60-token prompt in one step, with slices of 4 rows."""
    path, hf = llama
    llm = LLM(path, num_kvcache_blocks=16, max_num_seqs=4)
    prompt = random_prompts([60])[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=4), use_tqdm=False)[0]
    assert_prompt_logprobs_match(hf, prompt, out.prompt_logprobs, 4)


def test_triton_kernels(llama):
    """Guards against the Triton backend's attention giving other prompt rows than the PyTorch one (in the
    interpreter on a CPU: a tiny case)."""
    path, hf = llama
    llm = nanoserve.LLM(
        path, kernels="triton", dtype="float32", max_model_len=64, num_kvcache_blocks=8, max_num_batched_tokens=16
    )
    prompt = random_prompts([20])[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert_prompt_logprobs_match(hf, prompt, out.prompt_logprobs, 2)


@pytest.mark.parametrize("bad", [-1, 2.5, "3", True])
def test_bad_prompt_logprobs_refused_by_name(bad):
    with pytest.raises(InvalidField) as error:
        SamplingParams(prompt_logprobs=bad)
    assert error.value.field == "prompt_logprobs"


def test_over_the_vocabulary_refused_and_engine_usable(llama):
    """Guards against a topk past the vocabulary failing inside a step (and the engine after it)."""
    path, hf = llama
    llm = LLM(path, num_kvcache_blocks=8)
    prompt = random_prompts([6])[0]
    with pytest.raises(InvalidField) as error:
        llm.generate([prompt], SamplingParams(prompt_logprobs=hf.config.vocab_size + 1), use_tqdm=False)
    assert error.value.field == "prompt_logprobs"
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=hf.config.vocab_size), use_tqdm=False)
    assert len(out[0].prompt_logprobs[1]) == hf.config.vocab_size
    assert llm.stats()["kv_blocks_used"] == 0


def test_two_ranks_refused_by_name(llama):
    """Guards against prompt logprobs asked of a tensor-parallel engine hanging or mixing rows: each rank holds a slice
    of the vocabulary and the extension reads the hidden states on rank 0 alone, so the request is refused by name
    before any work, and the engine keeps serving."""
    extension_or_skip("tp")
    path, hf = llama
    llm = nanoserve.LLM(path, device="cpu", tensor_parallel_size=2, max_model_len=128, num_kvcache_blocks=16)
    prompt = random_prompts([9])[0]
    with pytest.raises(InvalidField) as error:
        llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=3), use_tqdm=False)
    assert error.value.field == "prompt_logprobs"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    llm.close()
