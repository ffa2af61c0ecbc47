"""Structured outputs (nanoserve/structured.py and its hooks in the engine): outputs constrained to a JSON schema, any
JSON object, a regex, a choice or an EBNF grammar parse and validate; greedy constrained decoding equals transformers'
greedy with the same xgrammar mask applied per step; overlap on equals overlap off; bad parameters are refused as
structured_outputs before any work. The server's side (response_format, forced tool calls) is at the end, driven by
the official `openai` client on 127.0.0.1."""

import json
import re
import shutil
import sys

import pytest
import torch
from conftest import refused

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.ext.chat import chat_prompts  # noqa: E402
from nanoserve.ext.structured import StructuredOutputsParams  # noqa: E402
from nanoserve.sampling_params import InvalidField  # noqa: E402

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
        {"json": 5},  # not a schema at all
        {"json_object": 1},  # not a bool
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
def tiny_with_tokenizer(tiny_model, tmp_path_factory):
    """A copy of the tiny llama (vocabulary 384) with a byte-level tokenizer of 259 ids: pad, bos, eos, then the 256
    bytes (no merges). The model's ids past the tokenizer's are never allowed by a grammar. (A copy: the session's
    tiny llama is weights-only for every other test.)"""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    weights, hf = tiny_model("llama")
    folder = tmp_path_factory.mktemp("llama-with-tokenizer")
    shutil.copytree(weights, folder, dirs_exist_ok=True)
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


# ---- the server: response_format and forced tool calls, with the official openai client ---------------------------
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def client(llm):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    openai = pytest.importorskip("openai")
    from nanoserve.ext.server.app import serve_in_background

    with serve_in_background(llm) as base_url:
        yield openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=60)


def chat(client, messages: list[dict] = MESSAGES, **kwargs: object) -> object:
    return client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=MAX_TOKENS, temperature=0, **kwargs
    )


def test_server_response_format(client, llm):
    """json_schema output parses and validates against the schema; json_object output is a JSON object."""
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    message = chat(client, response_format=schema_format).choices[0].message
    jsonschema.validate(json.loads(message.content), PERSON)
    short = [{"role": "user", "content": 'Reply with the JSON object {"ok": true} and nothing else.'}]
    message = chat(client, short, response_format={"type": "json_object"}).choices[0].message
    assert isinstance(json.loads(message.content), dict)
    check_pool(llm)


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_server_forced_tool_call(client, llm, tool_choice):
    """A named function (among two tools), or "required" with one tool: the output is constrained to the function's
    parameters' schema and comes back as message.tool_calls, content null, finish_reason tool_calls."""
    tools = [WEATHER, TIME] if isinstance(tool_choice, dict) else [WEATHER]
    choice = chat(client, tools=tools, tool_choice=tool_choice).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    check_pool(llm)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),  # needs --enable-auto-tool-choice
        ({"tools": [WEATHER, TIME], "tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function"}], "tool_choice": "none"}, "tools"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
            "structured_outputs",
        ),
    ],
)
def test_server_refuses_what_it_cannot_do(client, kwargs, param):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, **kwargs)
    assert error.value.body["param"] == param


@pytest.mark.parametrize("tool_choice", ["none", None])
def test_server_tool_choice_none_renders_tools_only(client, tool_choice):
    """ "none", and tools without tool_choice on a server without --enable-auto-tool-choice (vLLM's rule): the tools
    go to the chat template, and the answer is plain text."""
    kwargs = {} if tool_choice is None else {"tool_choice": tool_choice}
    choice = chat(client, tools=[WEATHER], **kwargs).choices[0]
    assert choice.message.tool_calls is None and isinstance(choice.message.content, str)


def test_server_forced_tool_call_cut_at_max_tokens_says_length(client):
    """Guards against a named call whose arguments the model never finished (max_tokens came first) claiming
    finish_reason "tool_calls", which a client then parses and drops as invalid JSON: it says "length", as vLLM's,
    and its arguments are the unfinished text."""
    tool_choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=MESSAGES, tools=[WEATHER], tool_choice=tool_choice, max_tokens=3
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(choice.message.tool_calls[0].function.arguments)


BOUNDED = {  # every string and array bounded: the grammar must close them, however much the model wants more
    "type": "object",
    "properties": {
        "word": {"type": "string", "maxLength": 4},
        "list": {"type": "array", "items": {"type": "string", "maxLength": 2}, "maxItems": 2},
    },
    "required": ["word", "list"],
    "additionalProperties": False,
}


def test_max_length_and_max_items_bound_the_output(llm):
    """Guards against a grammar that ignores maxLength or maxItems (a model that rambles inside a string until
    max_tokens, which langchain then drops as invalid JSON): with a bias that makes the model want "a" forever, the
    bounded schema's output still closes every string and array in time and validates; the same schema without the
    bounds runs to max_tokens, unfinished, so the bias did push."""
    a = llm.tokenizer.encode("a")[0]
    push = {"temperature": 0, "logit_bias": {a: 30.0}}
    unbounded = {**BOUNDED, "properties": {"word": {"type": "string"}, "list": {"type": "array"}}}
    bounded_out, unbounded_out = llm.chat(
        [MESSAGES, MESSAGES],
        [constrained(structured_outputs={"json": schema}, **push) for schema in (BOUNDED, unbounded)],
        use_tqdm=False,
    )
    sample = bounded_out.outputs[0]
    assert sample.finish_reason == "stop", sample.text
    jsonschema.validate(json.loads(sample.text), BOUNDED)
    assert unbounded_out.outputs[0].finish_reason == "length" and "aaaa" in unbounded_out.outputs[0].text
    check_pool(llm)


def test_max_length_and_max_items_through_the_server(client, llm):
    """The same bounds as a client sends them, through the official openai client: a response_format json_schema and a
    forced tool call whose parameters are the bounded schema, the model pushed towards "a" forever by logit_bias (as
    a client may send it); each answer closes its strings and arrays in time and validates."""
    a = llm.tokenizer.encode("a")[0]
    push = {str(a): 30}
    schema_format = {"type": "json_schema", "json_schema": {"name": "bounded", "schema": BOUNDED, "strict": True}}
    reply = chat(client, response_format=schema_format, logit_bias=push).choices[0]
    assert reply.finish_reason == "stop", reply.message.content
    jsonschema.validate(json.loads(reply.message.content), BOUNDED)
    tool = {"type": "function", "function": {"name": "record", "parameters": BOUNDED}}
    forced = {"type": "function", "function": {"name": "record"}}
    reply = chat(client, tools=[tool], tool_choice=forced, logit_bias=push).choices[0]
    (call,) = reply.message.tool_calls
    assert reply.finish_reason == "tool_calls" and call.function.name == "record"
    jsonschema.validate(json.loads(call.function.arguments), BOUNDED)
    check_pool(llm)


def test_chat_template_renders_tools(tiny_with_tokenizer):
    """tools reach the chat template (transformers' apply_chat_template(tools=...)): a template that lists them."""
    folder, _, _ = tiny_with_tokenizer
    llm = LLM(folder, max_model_len=128, num_kvcache_blocks=8, dtype="float32")
    llm.tokenizer.chat_template = "{% for t in tools %}{{ t.function.name }};{% endfor %}{{ messages[0].content }}"
    (ids,) = chat_prompts(llm, [{"role": "user", "content": "hi"}], tools=[WEATHER, TIME])
    assert llm.tokenizer.decode(ids) == "get_weather;get_time;hi"
    llm.close()


# ---- limits, and constraints that leave no token (issue 44) --------------------------------------------------------
def test_a_grammar_past_the_size_limit_is_refused_by_name():
    """Guards against a grammar too large to compile in bounded time (a 779 KB schema took 15 s) being accepted: a
    schema, regex, grammar or list of choices longer than MAX_GRAMMAR_CHARS is refused as structured_outputs when the
    params are made, before it is parsed; one just within is accepted."""
    from nanoserve.ext.structured import MAX_GRAMMAR_CHARS

    def schema(n: int) -> dict:
        return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}

    n = 1
    while len(json.dumps(schema(n + 1))) <= MAX_GRAMMAR_CHARS:
        n += 1
    StructuredOutputsParams(json=schema(n))
    for value in (
        {"json": schema(n + 1)},
        {"json": json.dumps(schema(n + 1))},
        {"regex": "a" * (MAX_GRAMMAR_CHARS + 1)},
        {"grammar": 'root ::= "' + "a" * MAX_GRAMMAR_CHARS + '"'},
        {"choice": ["ab"] * (MAX_GRAMMAR_CHARS // 6)},
    ):
        error = refused("structured_outputs", SamplingParams, structured_outputs=value)
        assert str(MAX_GRAMMAR_CHARS) in error.problem


def test_constraints_that_leave_no_token_end_the_request_never_a_forbidden_token(tiny_with_tokenizer):
    """Guards against a request whose constraints leave no token sampling one in neither set (allowed_token_ids=[5]
    with choice ["Paris"] gave tokens of neither, finish reason "length"): allowed ids the grammar does not allow at its
    start end the request before any work (no step computes it); allowed ids the grammar stops allowing, or a grammar
    that allows only the stop ids that min_tokens bans, end it at that step. Each ends with finish reason "error" and
    an error that says so, its tokens all allowed; the others in the batch run as alone."""
    folder, _, tokenizer = tiny_with_tokenizer
    llm = LLM(folder, max_model_len=128, num_kvcache_blocks=32, dtype="float32")
    a, c, x = tokenizer.convert_tokens_to_ids(["a", "c", "x"])  # byte tokens: "ac" is [a, c]
    prompt = torch.randint(3, 259, (6,)).tolist()
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = llm.generate(prompt, plain, use_tqdm=False)[0].outputs[0].token_ids
    cases = {
        "at the start": (
            SamplingParams(temperature=0, allowed_token_ids=[x], structured_outputs={"choice": ["ac"]}),
            [],
        ),
        "after a": (SamplingParams(temperature=0, allowed_token_ids=[a], structured_outputs={"choice": ["ac"]}), [a]),
        "min_tokens": (SamplingParams(temperature=0, min_tokens=5, structured_outputs={"choice": ["ac"]}), [a, c]),
    }
    says = {
        "at the start": "allowed_token_ids: ",
        "after a": "allowed_token_ids: ",
        "min_tokens": "structured_outputs: the grammar allows only stop ids",
    }
    computed = llm.stats()["computed_tokens"]
    first = llm.generate(prompt, cases["at the start"][0], use_tqdm=False)[0]
    assert first.outputs[0].finish_reason == "error" and first.error.startswith(says["at the start"]), first
    assert llm.stats()["computed_tokens"] == computed and first.outputs[0].token_ids == []  # before any work
    outs = llm.generate([prompt] * 4, [*(params for params, _ in cases.values()), plain], use_tqdm=False)
    for (name, (_, tokens)), out in zip(cases.items(), outs, strict=False):
        assert out.outputs[0].finish_reason == "error" and out.error.startswith(says[name]), (name, out)
        assert out.outputs[0].token_ids == tokens, name
    assert outs[3].outputs[0].token_ids == alone
    check_pool(llm)
    llm.close()


def test_a_grammar_is_parsed_once_and_equal_texts_compile_once(llm, monkeypatch):
    """Guards against the compile parsing the grammar's text again (work done twice), and against equal texts not
    sharing their compile: the params' parse is the compile's input; a second request with an equal schema finds the
    first one's compile."""
    from nanoserve.ext import structured

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    first, second = (constrained(temperature=0, structured_outputs={"json": schema}) for _ in range(2))
    assert first.structured_outputs.key == second.structured_outputs.key
    parsed, compiled = [], []
    monkeypatch.setattr(structured, "parse", lambda *text: parsed.append(text))  # any parse from now on is counted
    compile_grammar = structured.compile_grammar

    def counted(tokenizer, vocab_size, key):
        compiled.append(key)
        return compile_grammar(tokenizer, vocab_size, key)

    monkeypatch.setattr(structured, "compile_grammar", counted)
    outputs = llm.chat([MESSAGES, MESSAGES], [first, second], use_tqdm=False)
    assert parsed == [] and compiled == [first.structured_outputs.key]
    for output in outputs:
        assert isinstance(json.loads(output.outputs[0].text)["n"], int)
    check_pool(llm)
