"""The core and its extensions (nanoserve/ext/__init__.py): an option that belongs to an extension is refused by name
(InvalidField) when the extension is not installed, never ignored; an option left at the value that asks for nothing
(vLLM's default) needs no extension. Each test blocks the extension's import (as a deleted file would), so these run
with every extension present too; .ci/run also runs the core's tests with nanoserve/ext/ emptied."""

import json
import shutil
import sys

import pytest
from conftest import TINY, random_prompts, refused
from transformers import AutoConfig, AutoModelForCausalLM

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.ext import ENGINE_OPTIONS, MODEL_TYPES, REQUEST_FIELDS, asks_for_nothing

# a value of each option that asks for its extension
ASKING = {
    "n": 2,
    "logit_bias": {5: 1.0},
    "repetition_penalty": 1.1,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "structured_outputs": {"regex": "[ab]+"},
    "allowed_token_ids": [5, 6],
    "bad_words": ["word"],
    "tensor_parallel_size": 2,
    "trace": "trace.jsonl",
    "speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2},
    "lora_config": {"max_loras": 2},
    "cascade_attention": True,
    "latency_kernels": True,
    "prompt_logprobs": 2,
    "quantization": "awq",
    "kv_offloading_size": 1.0,
    "kv_offloading_backend": "native",
    "kv_transfer_config": {"kv_role": "kv_both"},
}


def without(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Import of nanoserve.ext.<name> now fails as if its file were deleted (ModuleNotFoundError)."""
    for name in names:
        monkeypatch.setitem(sys.modules, f"nanoserve.ext.{name}", None)


def test_every_option_of_the_tables_is_covered():
    """Guards against an extension option added to the registry's tables without a test of its refusal here."""
    assert set(ASKING) == set(REQUEST_FIELDS) | set(ENGINE_OPTIONS)


@pytest.mark.parametrize("field", sorted(REQUEST_FIELDS))
def test_a_request_field_without_its_extension_is_refused_by_name(field, monkeypatch):
    """Guards against a request field being silently ignored when its extension is deleted."""
    without(monkeypatch, REQUEST_FIELDS[field][0])
    error = refused(field, SamplingParams, **{field: ASKING[field]})
    assert f"nanoserve.ext.{REQUEST_FIELDS[field][0]}" in str(error)


@pytest.mark.parametrize("option", sorted(ENGINE_OPTIONS))
def test_an_engine_option_without_its_extension_is_refused_by_name(option, monkeypatch, tmp_path):
    """Guards against an engine option being silently ignored when its extension is deleted."""
    without(monkeypatch, ENGINE_OPTIONS[option][0])
    value = ASKING[option] if option != "trace" else str(tmp_path / ASKING[option])
    refused(option, EngineConfig, device="cpu", **{option: value})


def test_values_that_ask_for_nothing_need_no_extension(monkeypatch):
    """Guards against vLLM's defaults, passed explicitly, needing an extension: they ask for nothing (1 as 1.0, an
    empty logit_bias), while a bool is never taken for a number."""
    without(monkeypatch, *{name for name, _ in [*REQUEST_FIELDS.values(), *ENGINE_OPTIONS.values()]})
    params = SamplingParams(
        logit_bias={}, repetition_penalty=1, presence_penalty=0.0, frequency_penalty=0, structured_outputs=None
    )
    assert params.extensions == ()
    config = EngineConfig(
        device="cpu",
        tensor_parallel_size=1,
        trace=None,
        lora_config=None,
        cascade_attention=False,
        latency_kernels=False,
    )
    assert config.extensions == () and EngineConfig(device="cpu").extensions == ()
    assert not asks_for_nothing(True, 1.0) and not asks_for_nothing(False, 0.0) and not asks_for_nothing([], None)
    assert asks_for_nothing(False, False) and not asks_for_nothing(0, False) and not asks_for_nothing(True, False)


def test_the_default_model_beam_search_and_chat_without_their_extensions(tiny_model, monkeypatch):
    """Guards against LLM() (the embedded default model), LLM.beam_search or LLM.chat failing with anything but an
    InvalidField naming what asked for them when their extensions are deleted; the engine serves on."""
    without(monkeypatch, "default_model", "beam_search", "chat")
    refused("model", LLM, device="cpu")
    llm = LLM(tiny_model("llama")[0], device="cpu", max_model_len=64, num_kvcache_blocks=16)
    prompt = random_prompts([5])[0]
    refused("beam_search", llm.beam_search, [prompt], object())  # refused before its params are looked at
    refused("messages", llm.chat, [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="nanoserve.ext.beam_search"):  # vLLM's import place names it too
        from nanoserve.sampling_params import BeamSearchParams  # noqa: F401
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4 and llm.stats()["kv_blocks_used"] == 0


def test_vllm_names_without_their_extension_are_unknown(monkeypatch, tiny_model):
    """Guards against vLLM's names reaching the config when their extension is deleted: they are unknown options, and a
    vLLM prompt dict is refused as "prompt" (the engine serves on)."""
    without(monkeypatch, "vllm_names")
    llm = LLM(tiny_model("llama")[0], device="cpu", max_model_len=64, num_kvcache_blocks=16)
    prompt = random_prompts([5])[0]
    assert "vllm_names" in str(refused("prompt", llm.generate, {"prompt_token_ids": prompt}, use_tqdm=False))
    out = llm.generate(prompt, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2
    assert "unknown" in refused("block_size", EngineConfig.from_kwargs, device="cpu", block_size=16).problem
    assert EngineConfig.from_kwargs(device="cpu", kvcache_block_size=32).kvcache_block_size == 32


def test_lora_without_its_extension_is_refused_by_name(tiny_model, monkeypatch):
    """Guards against LoRA's options being ignored when ext/lora.py is deleted: generate's lora_request and vLLM's
    enable_lora are InvalidFields naming them (enable_lora: as a name ext/vllm_names.py refuses without the extension,
    or an unknown key without either), and the engine serves on."""
    without(monkeypatch, "lora")
    refused("enable_lora", LLM, device="cpu", enable_lora=True)
    llm = LLM(tiny_model("llama")[0], device="cpu", max_model_len=64, num_kvcache_blocks=16)
    prompt = random_prompts([5])[0]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    refused("lora_request", llm.generate, prompt, params, use_tqdm=False, lora_request=("an adapter", 1, "path"))
    out = llm.generate(prompt, params, use_tqdm=False, lora_request=None)[0]
    assert len(out.outputs[0].token_ids) == 4 and llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("model_type", sorted(MODEL_TYPES))
def test_a_model_type_without_its_extension_is_refused_by_name(model_type, monkeypatch, tmp_path):
    """Guards against a checkpoint of a family an extension serves (Qwen3-MoE, Mixtral: ext/moe) failing with anything
    but an InvalidField naming the model and the missing extension when the extension is deleted."""
    without(monkeypatch, MODEL_TYPES[model_type])
    config = AutoConfig.for_model(model_type, **TINY, num_experts=4, moe_intermediate_size=32)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    error = refused("model", LLM, str(tmp_path), device="cpu", max_model_len=64)
    assert f"nanoserve.ext.{MODEL_TYPES[model_type]}" in str(error)


def test_a_quantized_checkpoint_without_its_extension_is_refused_by_name(tiny_model, tmp_path, monkeypatch):
    """Guards against a checkpoint whose config.json has a quantization_config being read as a 16-bit one (its packed
    tensors misread, or the loader failing on them) when ext/quantization is deleted: an InvalidField naming
    quantization and the missing extension, before any weight is read."""
    without(monkeypatch, "quantization")
    path = tmp_path / "quantized"
    shutil.copytree(tiny_model("llama")[0], path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False}
    (path / "config.json").write_text(json.dumps(config))
    assert "nanoserve.ext.quantization" in str(refused("quantization", LLM, str(path), device="cpu"))
