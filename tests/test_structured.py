"""Structured outputs (nanoserve/structured.py and its hooks in the engine): outputs constrained to a JSON schema, any
JSON object, a regex, a choice or an EBNF grammar parse and validate; greedy constrained decoding equals transformers'
greedy with the same xgrammar mask applied per step; overlap on equals overlap off; bad parameters are refused as
structured_outputs before any work. The server's side (response_format, forced tool calls) is at the end, driven by
the official `openai` client on 127.0.0.1."""

import json
import re
import sys

import pytest
import torch

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.sampling_params import InvalidField  # noqa: E402
from nanoserve.structured import StructuredOutputsParams  # noqa: E402

MAX_TOKENS = 40
PERSON = {  # nested objects, arrays and enums, each bounded so that 40 tokens finish it
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 3},
        "pet": {
            "type": "object",
            "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "maximum": 4}},
            "required": ["kind", "legs"],
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 1},
    },
    "required": ["name", "pet", "tags"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a person and their pet as JSON."}]


@pytest.fixture(scope="module")
def llm():
    from conftest import default_model_or_skip

    default_model_or_skip()
    engine = LLM(max_model_len=512, num_kvcache_blocks=64)
    yield engine
    engine.close()


def constrained(max_tokens: int = MAX_TOKENS, **kwargs: object) -> SamplingParams:
    """Sampled (seeded) unless a temperature is given; n and the structured_outputs form in kwargs."""
    return SamplingParams(**{"temperature": 0.8, "seed": 1, "max_tokens": max_tokens, **kwargs})


def check_pool(llm: LLM) -> None:
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks  # every block back in the pool


def test_json_schema_outputs_parse_and_validate(llm):
    """A schema with nested objects, arrays and enums, n=2 samples each with its own matcher (a shared one would
    see the other sample's tokens and break both), given as a dict and as a JSON string."""
    params = [
        constrained(n=2, structured_outputs={"json": PERSON}),
        constrained(structured_outputs=StructuredOutputsParams(json=json.dumps(PERSON)), temperature=0),
    ]
    outs = llm.chat([MESSAGES, MESSAGES], params, use_tqdm=False)
    samples = [s for out in outs for s in out.outputs]
    assert len(samples) == 3
    for sample in samples:
        assert sample.finish_reason == "stop", sample.text
        jsonschema.validate(json.loads(sample.text), PERSON)
    check_pool(llm)


def test_json_object_regex_choice_and_grammar(llm):
    """Each other form: json_object gives a JSON object; regex and grammar outputs match; a choice is one of them."""
    choices = ["red", "green", "dark blue"]
    forms = {
        "json_object": ({"json_object": True}, lambda text: isinstance(json.loads(text), dict)),
        "regex": ({"regex": r"[0-9]{3}-[a-z]{2,4}"}, lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text)),
        "choice": ({"choice": choices}, lambda text: text in choices),
        "grammar": ({"grammar": 'root ::= "x" [a-c]{1,5} "."'}, lambda text: re.fullmatch(r"x[a-c]{1,5}\.", text)),
    }
    params = [constrained(n=2, structured_outputs=form) for form, _ in forms.values()]
    outs = llm.chat([MESSAGES] * len(forms), params, use_tqdm=False)
    for (name, (_, is_valid)), out in zip(forms.items(), outs, strict=True):
        for sample in out.outputs:
            assert sample.finish_reason == "stop" and is_valid(sample.text), (name, sample.text)
    check_pool(llm)


@pytest.mark.parametrize(
    "value",
    [
        {"json": {"type": "nope"}},  # not a schema xgrammar knows
        {"json": "{not json"},
        {"regex": "a(("},
        {"grammar": "root ::= "},
        {"choice": "yes"},  # not a list
        {"choice": []},
        {},  # nothing asked for
        {"json": PERSON, "regex": "a"},  # two things
        {"jsn": PERSON},  # not a field
        "json",  # not a dict
    ],
)
def test_bad_structured_outputs_are_refused_by_name(llm, value):
    """Refused as structured_outputs when the params are made, before any work; the engine serves on."""
    with pytest.raises(InvalidField) as error:
        SamplingParams(structured_outputs=value)
    assert error.value.field == "structured_outputs"


def test_missing_xgrammar_is_named_with_its_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now raises ImportError
    with pytest.raises(InvalidField, match="pip install xgrammar") as error:
        SamplingParams(structured_outputs={"regex": "a+"})
    assert error.value.field == "structured_outputs"


# ---- a tiny random model with a byte-level tokenizer: against transformers, and with overlap ----------------------
@pytest.fixture(scope="module")
def tiny_with_tokenizer(tiny_model):
    """The tiny llama (vocabulary 384) with a byte-level tokenizer of 259 ids: pad, bos, eos, then the 256 bytes (no
    merges). The model's ids past the tokenizer's are never allowed by a grammar."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder, hf = tiny_model("llama")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {c: i + 3 for i, c in enumerate(alphabet)}
    backend = Tokenizer(models.BPE(vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.save_pretrained(folder)
    return folder, hf, tokenizer


def masked_greedy(hf, tokenizer, grammar: StructuredOutputsParams, prompt: list[int], max_tokens: int) -> list[int]:
    """The plain reference: transformers' logits, xgrammar's mask applied with the same stop token, the argmax."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=hf.config.vocab_size)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(grammar.rules), override_stop_tokens=[2])
    bitmask = xgr.allocate_token_bitmask(1, hf.config.vocab_size)
    ids = list(prompt)
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[:, -1].float()  # [1, vocab]
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        token = int(logits.argmax())
        ids.append(token)
        assert matcher.accept_token(token)
        if token == 2:  # EOS
            break
    return ids[len(prompt) :]


def test_greedy_constrained_output_equals_transformers_with_the_same_mask(tiny_with_tokenizer):
    """Masked per row on the device, after the bans: a random model's greedy output under a grammar equals
    transformers' greedy with xgrammar's mask applied per step."""
    folder, hf, tokenizer = tiny_with_tokenizer
    llm = LLM(folder, max_model_len=128, num_kvcache_blocks=32, kvcache_block_size=16, dtype="float32")
    grammars = [
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
        StructuredOutputsParams(regex="[a-f]{3}[0-9]+"),
    ]
    prompts = [torch.randint(3, 259, (n,)).tolist() for n in (5, 9)]
    params = [SamplingParams(temperature=0, max_tokens=24, structured_outputs=g) for g in grammars]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, grammar, prompt in zip(outs, grammars, prompts, strict=True):
        assert out.outputs[0].token_ids == masked_greedy(hf, tokenizer, grammar, prompt, 24)
    check_pool(llm)
    llm.close()


def test_overlap_on_equals_overlap_off(tiny_with_tokenizer):
    """With overlap the next step is launched before the last one's tokens are read back: a constrained sequence's
    mask would miss its newest token. The engine runs the plain loop while one runs: the same seeded samples, for
    constrained requests beside plain ones, as with overlap off."""
    folder, _, _ = tiny_with_tokenizer
    prompts = [torch.randint(3, 259, (n,)).tolist() for n in (4, 7, 6)]
    params = [
        SamplingParams(max_tokens=20, seed=3),  # unconstrained: overlapped until a constrained one runs
        SamplingParams(max_tokens=20, seed=4, n=2, structured_outputs={"regex": "[a-z]+( [a-z]+)*"}),
        SamplingParams(max_tokens=20, seed=5, structured_outputs={"json_object": True}),
    ]
    results = []
    for overlap in (False, True):
        llm = LLM(folder, max_model_len=128, num_kvcache_blocks=32, dtype="float32", overlap=overlap)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([s.token_ids for out in outs for s in out.outputs])
        check_pool(llm)
        llm.close()
    assert results[0] == results[1]
