"""Each model family against transformers on the same random weights, fp32 on CPU: greedy tokens and
logprobs must match, with prompts of different lengths batched together."""

from functools import partial

import pytest
import torch
from conftest import FAMILIES, hf_greedy, random_prompts

import nanoserve
from nanoserve import SamplingParams

LLM = partial(nanoserve.LLM, device="cpu")  # CPU semantics in fp32 on any machine; GPU: test_gpu.py


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_matches_transformers(tiny_model, family):
    """Guards against any model bug (RoPE variant, qk-norm, bias, GQA, tied heads, fused projections)
    and against batching bugs that let sequences of different lengths disturb each other."""
    path, hf = tiny_model(family)
    llm = LLM(path, max_model_len=256, num_kvcache_blocks=64)
    prompts = random_prompts([3, 17, 40, 64])
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=False):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 32)
        assert out.prompt_token_ids == prompt and out.outputs[0].finish_reason == "length"
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_logprobs_match_transformers(tiny_model, family):
    """Guards against logprobs taken after temperature/filters, or from the wrong row of the batch."""
    path, hf = tiny_model(family)
    llm = LLM(path, max_model_len=256, num_kvcache_blocks=64)
    prompts = random_prompts([9, 30])
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3), use_tqdm=False
    )
    for prompt, out in zip(prompts, outs, strict=False):
        ids = torch.tensor([prompt + out.outputs[0].token_ids])
        with torch.no_grad():
            ref = hf(ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)  # [8, vocab]
        for step, (token, lp) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=False)):
            top = ref[step].topk(3)
            expected = dict(zip(top.indices.tolist(), top.values.tolist(), strict=False))
            expected[token] = ref[step, token].item()
            assert lp.keys() == expected.keys()
            for t in lp:
                assert abs(lp[t] - expected[t]) < 1e-4
