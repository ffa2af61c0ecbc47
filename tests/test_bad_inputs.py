"""Bad input that used to fail with the wrong kind of error, or late: numbers too large for a float, numpy and
Fraction values, lone surrogates, unknown chat roles, non-bool flags, and broken model folders or engine settings
that were only found after the weights had loaded. Every refusal is an InvalidField naming its field; every accepted
value is stored as a plain Python int or float; afterwards the engine still generates correctly with no block in use."""

import json
import os
import pathlib
import shutil
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch
from conftest import default_model_or_skip, hf_greedy, random_prompts, refused
from safetensors.torch import load_file, save_file

import nanoserve.model_runner
from nanoserve import LLM, SamplingParams
from nanoserve.checks import MAX_INT
from nanoserve.sampling_params import SEED_RANGE

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
HUGE = 10**400  # too large for a float: float(HUGE) raises OverflowError
UNPRINTABLE = 10**5000  # past Python's 4,300-digit limit: even repr(UNPRINTABLE) raises


def still_serves(llm: LLM, hf: object) -> None:
    """Nothing queued, no block in use, and greedy output still that of transformers."""
    assert not llm.has_unfinished_requests() and llm.stats()["kv_blocks_used"] == 0
    prompt = random_prompts([7])[0]
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(hf, prompt, 6)
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.fixture(scope="module")
def engine(tiny_model):
    path, hf = tiny_model("llama")
    return LLM(path, device="cpu", max_model_len=64, num_kvcache_blocks=16, max_num_seqs=4), hf


@pytest.fixture
def no_weights_loaded(monkeypatch):
    """Fails the test if an LLM gets as far as loading weights: the check must come first."""

    def fail(*args: object) -> None:
        raise AssertionError("the weights were loaded before the input was checked")

    monkeypatch.setattr(nanoserve.model_runner, "build_model", fail)


# ---- sampling parameters -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["n", "max_tokens", "min_tokens", "top_k", "logprobs", "temperature"])
@pytest.mark.parametrize("value", [HUGE, -HUGE, UNPRINTABLE], ids=["10**400", "-10**400", "10**5000"])
def test_integers_too_large_for_a_float_are_out_of_range(field, value):
    """Guards against the range check converting an integer to a float (OverflowError), or printing it whole
    (ValueError past 4,300 digits), instead of naming the field."""
    refused(field, SamplingParams, **{field: value})


def test_numpy_and_fraction_values_are_stored_as_python_numbers(engine):
    """Guards against numpy scalars passing the check and failing in the first step (np.int64 seeds overflowed in
    the sampler's seed arithmetic; np.uint64 ones were a TypeError), and Fraction temperatures failing at launch."""
    llm, hf = engine
    params = SamplingParams(
        n=np.int64(1),  # (n > 1: tests/ext/test_parallel_sampling.py)
        temperature=Fraction(1, 2),
        top_p=np.float32(0.5),
        top_k=np.int32(5),
        min_p=np.float16(0.25),
        max_tokens=np.uint8(5),
        min_tokens=np.int16(1),
        seed=np.uint64(2**64 - 1),
        logprobs=np.int64(2),
        ignore_eos=True,
    )
    for name in ("n", "top_k", "max_tokens", "min_tokens", "seed", "logprobs"):
        assert type(getattr(params, name)) is int, name
    for name in ("temperature", "top_p", "min_p"):
        assert type(getattr(params, name)) is float, name
    assert params.temperature == 0.5 and params.seed == (2**64 - 1) % SEED_RANGE
    outputs = llm.generate(random_prompts([5])[0], params, use_tqdm=False)[0].outputs
    assert [len(o.token_ids) for o in outputs] == [5] and all(len(o.logprobs[0]) >= 2 for o in outputs)
    still_serves(llm, hf)


def test_any_integer_seed_is_kept_in_range_and_draws_the_same(engine):
    """Guards against huge or negative seeds failing (OverflowError in the check) or drawing differently from the
    same seed mod 2**63, which is all the sampler ever used of them."""
    llm, hf = engine
    prompt = random_prompts([5])[0]
    draws = []
    for seed in (HUGE, HUGE % SEED_RANGE, -1, SEED_RANGE - 1):
        params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=seed)
        assert 0 <= params.seed < SEED_RANGE
        draws.append(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
    assert draws[0] == draws[1] and draws[2] == draws[3]
    still_serves(llm, hf)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": Decimal("0.5")}, "temperature"),  # not a numbers.Real
        ({"temperature": 1e31}, "temperature"),  # past MAX_TEMPERATURE
        ({"top_p": Fraction(3, 2)}, "top_p"),
        ({"max_tokens": MAX_INT + 1}, "max_tokens"),
        ({"seed": np.float64(5)}, "seed"),
        ({"seed": True}, "seed"),
        ({"ignore_eos": np.bool_(True)}, "ignore_eos"),
    ],
    ids=str,
)
def test_other_bad_numbers_name_the_field(kwargs, field):
    """Guards against values of a near-miss type or just past a stated bound being taken."""
    refused(field, SamplingParams, **kwargs)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
        ({"skip_special_tokens": 1}, "skip_special_tokens"),
    ],
    ids=str,
)
def test_bad_text_flags_name_the_field(kwargs, field):
    """Guards against text flags that are not bools being taken (a string "yes", an int 1). The penalties' and
    logit_bias' bad values are their extension's tests (tests/ext/test_penalties.py)."""
    refused(field, SamplingParams, **kwargs)


# ---- requests ------------------------------------------------------------------------------------------------------
def test_bad_flags_name_the_field(engine):
    """Guards against stream="no" and use_tqdm="no" being taken as true. (n beyond what a step can run:
    tests/ext/test_parallel_sampling.py.)"""
    llm, hf = engine
    prompt = random_prompts([5])[0]
    refused("stream", llm.add_request, prompt, GREEDY, stream="no")
    refused("use_tqdm", llm.generate, prompt, GREEDY, use_tqdm="no")
    still_serves(llm, hf)


@pytest.fixture(scope="module")
def chat_engine():
    default_model_or_skip()
    return LLM(device="cpu", max_model_len=128, num_kvcache_blocks=16)


def test_lone_surrogates_and_unknown_roles_are_refused_before_the_tokenizer(chat_engine):
    """Guards against text with a lone surrogate reaching the tokenizer (a TypeError; a 500 on the server), and
    chat messages with a role the template does not know ("banana", "") or a name that is not a string."""
    llm = chat_engine
    refused("prompt", llm.generate, "\ud800", GREEDY, use_tqdm=False)
    refused("prompt", llm.generate, ["fine", "ok \udfff"], GREEDY, use_tqdm=False)
    for messages in (
        [{"role": "user", "content": "\ud800"}],
        [{"role": "banana", "content": "hi"}],
        [{"role": "", "content": "hi"}],
        [{"role": "user", "content": "hi", "name": 5}],
        [{"role": "system", "content": "be brief"}, {"role": ["user"], "content": "hi"}],
    ):
        refused("messages", llm.chat, messages, GREEDY, use_tqdm=False)
    assert llm.stats()["kv_blocks_used"] == 0
    for role in ("system", "user"):
        out = llm.chat([{"role": role, "content": "Hi", "name": "ann"}], GREEDY, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 6 and llm.stats()["kv_blocks_used"] == 0


# ---- engine settings -----------------------------------------------------------------------------------------------
def test_bad_engine_settings_are_refused_before_the_weights_load(tiny_model, tmp_path, engine, no_weights_loaded):
    """Guards against settings found bad only after the model had loaded (a KV pool beyond memory failing in the
    allocator), or never (threads=10**6 handed to torch), and huge ints as OverflowError."""
    path, _ = tiny_model("llama")
    cases = [
        ({"max_model_len": HUGE}, "max_model_len"),
        ({"max_num_seqs": UNPRINTABLE}, "max_num_seqs"),
        ({"gpu_memory_utilization": HUGE}, "gpu_memory_utilization"),
        ({"num_kvcache_blocks": 10**12}, "num_kvcache_blocks"),  # 4 PB of KV for this model: more than any host has
        ({"threads": 10**6}, "threads"),
        ({"trace": b"trace.jsonl"}, "trace"),  # not a path (a path the trace cannot be: tests/ext/test_plots.py)
        ({"overlap": "no"}, "overlap"),
    ]
    for kwargs, field in cases:
        refused(field, LLM, path, **({"device": "cpu", "max_model_len": 64} | kwargs))
    still_serves(*engine)


def test_paths_may_be_pathlib_paths(tiny_model):
    """Guards against LLM(model=pathlib.Path(...)) being refused as "not a path" (trace=, which takes one too, is its
    extension's test: tests/ext/test_plots.py)."""
    path, hf = tiny_model("llama")
    llm = LLM(pathlib.Path(path), device="cpu", max_model_len=64, num_kvcache_blocks=8)
    assert llm.config.model == path
    still_serves(llm, hf)


# ---- model folders -------------------------------------------------------------------------------------------------
def broken_copy(tmp_path: pathlib.Path, path: str, name: str) -> pathlib.Path:
    """A copy of the model folder at path, to break."""
    copy = tmp_path / name
    shutil.copytree(path, copy)
    return copy


def edit_config(folder: pathlib.Path, **changes: object) -> None:
    config_file = folder / "config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | changes))


def edit_weights(folder: pathlib.Path, edit: object) -> None:
    weights_file = folder / "model.safetensors"
    tensors = load_file(weights_file)
    edit(tensors)
    save_file(tensors, weights_file)


def breakages(folder: pathlib.Path) -> dict[str, tuple[object, str]]:
    """name -> (how to break a copy of the model folder, what the error must name)."""
    weights = folder / "model.safetensors"
    layer0 = "model.layers.0.self_attn.q_proj.weight"
    return {
        "no config.json": (lambda f: (f / "config.json").unlink(), "config.json"),
        "config.json not JSON": (lambda f: (f / "config.json").write_text("{not json"), "config.json"),
        "config.json a list": (lambda f: (f / "config.json").write_text("[1, 2]"), "config.json"),
        "unknown model_type": (lambda f: edit_config(f, model_type="banana"), "config.json"),
        "no attention heads": (lambda f: edit_config(f, num_attention_heads=0), "num_attention_heads"),
        "heads as a string": (lambda f: edit_config(f, num_attention_heads="4"), "num_attention_heads"),
        "config says wider": (lambda f: edit_config(f, hidden_size=128), "model.embed_tokens.weight"),
        "config says more layers": (lambda f: edit_config(f, num_hidden_layers=3), "model.layers.2"),
        "a tensor missing": (lambda f: edit_weights(f, lambda t: t.pop(layer0)), "q_proj"),
        "an extra tensor": (lambda f: edit_weights(f, lambda t: t.update(extra=torch.zeros(2))), "extra"),
        "a tensor misshapen": (lambda f: edit_weights(f, lambda t: t.update({layer0: t[layer0][:8]})), layer0),
        "garbage weights": (lambda f: (f / "model.safetensors").write_bytes(b"garbage" * 100), "model.safetensors"),
        "weights cut short": (
            lambda f: (f / "model.safetensors").write_bytes(weights.read_bytes()[: weights.stat().st_size // 2]),
            "model.safetensors",
        ),
        "no weights": (lambda f: (f / "model.safetensors").unlink(), "safetensors"),
    }


def test_broken_model_folders_are_refused_before_the_weights_load(tiny_model, tmp_path, engine, no_weights_loaded):
    """Guards against a broken model folder surfacing as transformers', safetensors', torch's or Python's own error
    (ValueError without a field, OSError, SafetensorError, a size mismatch, ZeroDivisionError) after some loading:
    each is an InvalidField("model") naming the file, config field or tensor at fault, before any weight is read."""
    path, _ = tiny_model("llama")
    for name, (breaking, named) in breakages(pathlib.Path(path)).items():
        folder = broken_copy(tmp_path, path, name)
        breaking(folder)
        error = refused("model", LLM, str(folder), device="cpu", max_model_len=64, num_kvcache_blocks=8)
        assert named in str(error), (name, error)
    assert os.listdir(path)  # the original is untouched
    still_serves(*engine)
