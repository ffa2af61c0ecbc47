"""vLLM's names for LLM(...) options (nanoserve/ext/vllm_names.py): an option vLLM has and nanoserve does not is
accepted at vLLM's default value (it asks for nothing) and refused by name at any other, before any weight is read;
vLLM's aliases are translated; its prompt dicts are unwrapped. Code written for vLLM then runs unchanged where it asks
for nothing nanoserve lacks."""

import importlib.util

import pytest
from conftest import default_model_or_skip, hf_greedy, random_prompts, refused

import nanoserve.model_runner
from nanoserve import LLM, SamplingParams
from nanoserve.ext.vllm_names import VLLM_DEFAULTS

ENGINE = {"device": "cpu", "max_model_len": 64, "num_kvcache_blocks": 16}
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# options vLLM users pass, at values that ask for something nanoserve does not do
ASKING = {
    "swap_space": 8,
    "pipeline_parallel_size": 2,
    "cpu_offload_gb": 4,
    "revision": "main",
    "load_format": "gguf",
    "tokenizer_mode": "mistral",
    "enable_chunked_prefill": False,
    "max_seq_len_to_capture": 4096,
    "scheduling_policy": "priority",
    "disable_custom_all_reduce": 0,  # 0 is not False: a bool option takes a bool
}


@pytest.fixture
def no_weights_loaded(monkeypatch):
    """Fails the test if an LLM gets as far as loading weights: the check must come first."""

    def fail(*args: object) -> None:
        raise AssertionError("the weights were loaded before the arguments were checked")

    monkeypatch.setattr(nanoserve.model_runner, "build_model", fail)


def test_vllm_options_that_ask_for_something_are_refused_by_name(tiny_model, no_weights_loaded):
    """Guards against a vLLM option nanoserve does not implement being refused as unknown, or taken silently."""
    path, _ = tiny_model("llama")
    for name, value in ASKING.items():
        error = refused(name, LLM, path, **ENGINE, **{name: value})
        assert "vLLM option" in error.problem and "not implement" in error.problem


def test_vllm_options_at_their_default_are_accepted(tiny_model):
    """Guards against LLM(swap_space=4, enable_chunked_prefill=True, ...) being refused though it asks for nothing:
    every option of the table at every value it takes, all at once, and the engine generates as without them."""
    path, hf = tiny_model("llama")
    defaults = {name: values[-1] for name, values in VLLM_DEFAULTS.items()}
    llm = LLM(path, **ENGINE, **defaults, trust_remote_code=False, disable_log_stats=True)
    prompt = random_prompts([6])[0]
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(hf, prompt, 6)
    for name, values in VLLM_DEFAULTS.items():
        for value in values:
            assert nanoserve.config.EngineConfig.from_kwargs(device="cpu", **{name: value})


def test_vllm_aliases_and_flags(tiny_model, no_weights_loaded):
    """Guards against trust_remote_code=True being taken (nanoserve runs only its own model code), an alias given
    twice or a bad block size through it, and a flag that is not a bool; block_size is kvcache_block_size."""
    path, _ = tiny_model("llama")
    assert "own model code" in refused("trust_remote_code", LLM, path, trust_remote_code=True, **ENGINE).problem
    refused("trust_remote_code", LLM, path, trust_remote_code="no", **ENGINE)
    refused("disable_log_stats", LLM, path, disable_log_stats=1, **ENGINE)
    refused("block_size", LLM, path, block_size=16, kvcache_block_size=16, **ENGINE)
    refused("kvcache_block_size", LLM, path, block_size=8, **ENGINE)
    assert nanoserve.config.EngineConfig.from_kwargs(device="cpu", block_size=32).kvcache_block_size == 32
    # vLLM's disable_cascade_attn: False lets the engine use cascade attention (ext/cascade.py), True keeps it off
    config_of = nanoserve.config.EngineConfig.from_kwargs
    if importlib.util.find_spec("nanoserve.ext.cascade") is not None:
        assert config_of(device="cpu", disable_cascade_attn=False).cascade_attention is True
    assert config_of(device="cpu", disable_cascade_attn=True).cascade_attention is False
    refused("disable_cascade_attn", config_of, device="cpu", disable_cascade_attn="no")
    refused("disable_cascade_attn", config_of, device="cpu", disable_cascade_attn=True, cascade_attention=True)


@pytest.fixture(scope="module")
def with_tokenizer(tiny_model):
    """The tiny llama (weights only) with the default model's tokenizer (tokenizer=), and its transformers twin."""
    path, hf = tiny_model("llama")
    return LLM(path, tokenizer=default_model_or_skip(), **ENGINE), hf


def test_prompt_dicts(with_tokenizer):
    """Guards against vLLM's {"prompt": text} and {"prompt_token_ids": ids} being refused, alone or in a list (mixed
    with plain prompts), and against other keys or mismatched types being taken silently."""
    llm, hf = with_tokenizer
    text = "1+2=3; (a, b)"
    ids = llm.tokenizer.encode(text)
    assert max(ids) < 384, "a text the tiny model's vocabulary holds"
    expected = hf_greedy(hf, ids, 6)
    one = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    several = llm.generate([{"prompt": text}, ids, {"prompt_token_ids": ids}, text], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in one + several] == [expected] * 5
    assert one[0].prompt is None and several[0].prompt == text and several[0].prompt_token_ids == ids
    for bad, field in (
        ({"prompt": text, "multi_modal_data": {}}, "prompt"),
        ({"prompt": text, "prompt_token_ids": ids}, "prompt"),
        ({}, "prompt"),
        ({"prompt_token_ids": text}, "prompt_token_ids"),
        ({"prompt": ids}, "prompt"),
    ):
        refused(field, llm.generate, bad, GREEDY, use_tqdm=False)
        refused(field, llm.add_request, bad, GREEDY)
    error = refused("prompt", llm.generate, {"prompt": text, "multi_modal_data": {}}, GREEDY)
    assert "'multi_modal_data'" in str(error)
    assert not llm.has_unfinished_requests() and llm.stats()["kv_blocks_used"] == 0
