"""The embedded default model (SmolLM2-135M-Instruct) end to end against transformers on the same folder:
greedy chat answers must be equal; stop strings cut the text; the chat template is the tokenizer's."""

import pytest
import torch

pytest.importorskip("gguf")
from conftest import default_model_or_skip  # noqa: E402

from nanoserve import LLM, SamplingParams  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Name three colors.", "What is 2 + 3?"]


@pytest.fixture(scope="module")
def engine():
    default_model_or_skip()
    return LLM(max_model_len=1024, device="cpu")  # fp32, as the reference; GPU: test_gpu.py


def test_greedy_chat_equals_transformers(engine):
    """Guards against any difference from the reference on a real checkpoint (weights, template, EOS)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_model_or_skip(), dtype=torch.float32).eval()
    tok = engine.tokenizer
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outs = engine.chat(conversations, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    for conv, out in zip(conversations, outs, strict=False):
        text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        assert out.prompt_token_ids == ids
        ref = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=32,
            do_sample=False,
        )[0, len(ids) :].tolist()
        assert out.outputs[0].token_ids == ref
        if out.outputs[0].finish_reason == "stop":
            assert out.outputs[0].token_ids[-1] == 2  # <|im_end|>
    assert "Paris" in outs[0].outputs[0].text
    assert engine.stats()["kv_blocks_used"] == 0


def test_stop_string_is_cut(engine):
    """Guards against stop strings that are ignored or left in the returned text."""
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    free = engine.chat(conv, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    word = free.outputs[0].text.split()[2]  # "The capital of ..." -> stop at the third word
    out = engine.chat(conv, SamplingParams(temperature=0, max_tokens=32, stop=[word]), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop" and word not in out.outputs[0].text
    assert free.outputs[0].text.startswith(out.outputs[0].text) and len(out.outputs[0].token_ids) < len(
        free.outputs[0].token_ids
    )
