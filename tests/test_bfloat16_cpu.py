"""bf16 on a CPU (dtype="bfloat16"): the fast choice where the CPU has native bf16 (AVX512-BF16, AMX, Arm's BF16).
Greedy output must agree with transformers run in bf16 on the same weights. Both round every layer to bf16, but in
different orders (fused projections, attention in fp32 here), so a near-tie can break either way: where the two
disagree, the two candidates' logits at the first divergence must lie within BF16_TIE_MARGIN of each other, by
transformers' own bf16 logits, and at most one prompt in four may diverge at all."""

import copy

import pytest
import torch
from conftest import FAMILIES, default_model_or_skip, random_prompts

from nanoserve import LLM, SamplingParams

NUM_TOKENS = 16
# bf16 keeps 8 significant bits: logits of size ~10 round in steps of 1/16, and a sum of several rounded terms
# can move by a few steps. Candidates closer than this are a tie at bf16's precision.
BF16_TIE_MARGIN = 0.25
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS)  # EOS ends both, as in transformers' generate


def bf16_greedy(hf: torch.nn.Module, prompt: list[int], num_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=num_tokens,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


def check_agreement(hf: torch.nn.Module, prompts: list[list[int]], outputs: list[list[int]]) -> int:
    """Asserts each disagreement is a near-tie; returns how many prompts disagreed."""
    num_diverged = 0
    for prompt, ours in zip(prompts, outputs, strict=True):
        theirs = bf16_greedy(hf, prompt, NUM_TOKENS)
        if ours == theirs:
            continue
        num_diverged += 1
        first = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + ours[:first]])).logits[0, -1].float()
        gap = abs(logits[ours[first]] - logits[theirs[first]]).item()
        assert gap <= BF16_TIE_MARGIN, f"diverged at token {first} with a logit gap of {gap:.3f}"
    return num_diverged


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bfloat16_greedy_agrees_with_transformers_in_bfloat16(tiny_model, family):
    """Guards against a bf16 path that is wrong rather than rounded differently (a cast in the wrong place, an fp32
    buffer read as bf16): such a bug shows up as divergences with large logit gaps, or on many prompts."""
    path, hf_fp32 = tiny_model(family)
    hf = copy.deepcopy(hf_fp32).to(torch.bfloat16)  # the same weights, rounded as nanoserve's loader rounds them
    llm = LLM(path, device="cpu", dtype="bfloat16", max_model_len=256, num_kvcache_blocks=64)
    assert llm.runner.dtype == torch.bfloat16
    prompts = random_prompts([3, 17, 40, 64])
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert check_agreement(hf, prompts, [o.outputs[0].token_ids for o in outs]) <= 1
    assert llm.stats()["kv_blocks_used"] == 0


def test_default_model_in_bfloat16_agrees_with_transformers():
    """The same on the real checkpoint: chat answers of the default model, 16 greedy tokens each."""
    from transformers import AutoModelForCausalLM

    model_dir = default_model_or_skip()
    llm = LLM(model_dir, device="cpu", dtype="bfloat16", max_model_len=512)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    questions = ["What is the capital of France?", "Name three colors.", "What is 2 + 3?", "Say hello."]
    prompts = llm.chat_prompts([[{"role": "user", "content": q}] for q in questions])
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert check_agreement(hf, prompts, [o.outputs[0].token_ids for o in outs]) <= 1
