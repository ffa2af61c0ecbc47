"""Shared fixtures: tiny random-weight models of each family, saved as HF directories, with their
transformers twin as the reference. On a machine without CUDA, Triton kernels run in its interpreter."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede any kernel definition

import pytest
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.05,  # peakier logits than the default: fewer near-ties in greedy
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = {
    "llama": lambda: LlamaConfig(**TINY, tie_word_embeddings=True),
    "llama3": lambda: LlamaConfig(**TINY, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=64)),
    "qwen2": lambda: Qwen2Config(**TINY, tie_word_embeddings=False),
    "qwen3": lambda: Qwen3Config(**dict(TINY, num_attention_heads=8), head_dim=16, tie_word_embeddings=True),
}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(family) -> (directory, transformers model in fp32), made once per session."""
    made = {}

    def make(family: str):
        if family not in made:
            torch.manual_seed(len(made))
            hf = AutoModelForCausalLM.from_config(FAMILIES[family]()).eval()
            path = tmp_path_factory.mktemp(family)
            hf.save_pretrained(path)
            made[family] = (str(path), hf)
        return made[family]
    return make


def random_prompts(lengths, vocab=TINY["vocab_size"]):
    return [torch.randint(3, vocab, (n,)).tolist() for n in lengths]  # 0-2: pad/bos/eos


def hf_greedy(hf, prompt, max_new_tokens):
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
