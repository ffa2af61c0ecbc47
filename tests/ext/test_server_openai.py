"""The server's contract with OpenAI's API beyond generation (nanoserve/server.py): every field honoured or refused by
name, chat messages in every form of the chat API, OpenAI's ranges, the context-length refusal, each logprob's own
UTF-8 bytes, and the API key. Most tests run against a fake engine (conftest's FakeEngine: the real loop without a
model), so they take milliseconds and need no model; those that need a tokenizer and a chat template use the default
model. Every server listens on 127.0.0.1, and the official `openai` client drives it where it can send the input."""

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

MODEL = "SmolLM2-135M-Instruct"  # the name the server gives its model when none is configured
API_KEY = "sk-nanoserve-test"
FAKE_MAX_MODEL_LEN = 64
TOKENS = [5, 6, 7]  # a prompt of token ids for the fake engine (it has no tokenizer)
MESSAGES = [{"role": "user", "content": "Name three colors."}]
GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": 8}


def client_for(base_url: str, api_key: str = "x") -> "openai.OpenAI":
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def fake_url():
    """A server on the fake engine, without an API key."""
    from conftest import FakeEngine

    from nanoserve.ext.server.app import serve_in_background

    fake = FakeEngine(num_blocks=64, block_size=16, max_model_len=FAKE_MAX_MODEL_LEN)
    with serve_in_background(fake.llm) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def served():
    """A server on the default model: (base URL, the test's own tokenizer)."""
    from conftest import default_model_or_skip
    from transformers import AutoTokenizer

    from nanoserve import LLM
    from nanoserve.ext.server.app import serve_in_background

    model_dir = default_model_or_skip()
    llm = LLM(max_model_len=512, num_kvcache_blocks=128)
    with serve_in_background(llm) as base_url:
        yield base_url, AutoTokenizer.from_pretrained(model_dir)
    llm.close()


# ---- every field honoured, accepted, or refused by name ---------------------------------------------------------
REFUSED = [  # (endpoint, fields added to a good body, the param the 400 names)
    # not implemented yet: refused, never silently ignored
    ("completions", {"echo": True, "stream": True}, "echo"),
    ("completions", {"best_of": 2}, "best_of"),
    ("completions", {"suffix": "end"}, "suffix"),
    ("completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("chat/completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
    ("completions", {"guided_json": {"type": "object"}}, "guided_json"),
    ("completions", {"response_format": {"type": "yaml"}}, "response_format"),
    # tools: "auto" needs a server started with --enable-auto-tool-choice (tests/ext/test_tool_calls.py has more)
    ("chat/completions", {"tool_choice": "auto"}, "tool_choice"),
    ("chat/completions", {"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs"),
    ("chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("chat/completions", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("chat/completions", {"stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
    # unknown keys, as OpenAI refuses them: a misspelling, and each endpoint's input on the other
    ("completions", {"temperatur": 0.5}, "temperatur"),
    ("completions", {"messages": MESSAGES}, "messages"),
    ("chat/completions", {"prompt": "hi"}, "prompt"),
    ("chat/completions", {"max_completion_tokens": 4, "max_tokenz": 4}, "max_tokenz"),
    # OpenAI's ranges
    ("completions", {"temperature": 2.01}, "temperature"),
    ("completions", {"top_p": 1.5}, "top_p"),
    ("completions", {"frequency_penalty": 2.5}, "frequency_penalty"),
    ("completions", {"presence_penalty": -3}, "presence_penalty"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {"logit_bias": {"five": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"100000": 1}}, "logit_bias"),  # outside the vocabulary
    ("completions", {"logit_bias": [5, 1]}, "logit_bias"),
    ("chat/completions", {"skip_special_tokens": "no"}, "skip_special_tokens"),
    ("completions", {"logprobs": 6}, "logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ("chat/completions", {"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    # content parts other than text, and malformed ones
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages[0].content[0].type",
    ),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "input_audio"}]}]},
        "messages[0].content[1].type",
    ),
    ("chat/completions", {"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content[0].type"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
        "messages[0].content[0].text",
    ),
]


@pytest.mark.parametrize("endpoint, fields, param", REFUSED)
def test_fields_not_honoured_are_refused_by_name(fake_url, endpoint, fields, param):
    """Guards against a field being silently ignored (a client asking for a penalty, a JSON schema or a tool call and
    getting a plain completion) and against an error that does not name the field: each gets a 400 with its param.
    The fake engine has no chat template, so a chat body that passes the field checks is refused as "model"."""
    body = {"prompt": TOKENS, "max_tokens": 2} if endpoint == "completions" else {"messages": MESSAGES}
    r = httpx.post(f"{fake_url}/{endpoint}", json={**body, **fields}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_the_official_client_sees_refusals_with_their_param(fake_url):
    """Guards against refusals the official client cannot attribute: BadRequestError carries the field as param, and
    the message says the feature is not implemented rather than that the value is wrong."""
    client = client_for(fake_url)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=TOKENS, max_tokens=2, best_of=2)
    assert e.value.param == "best_of" and "does not implement" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=TOKENS, max_tokens=2, extra_body={"temperatur": 0.5})
    assert e.value.param == "temperatur" and "unrecognized" in e.value.message


def test_metadata_and_values_that_ask_for_nothing_are_accepted(fake_url):
    """Guards against refusing what changes nothing the client gets: metadata (user, metadata, store, service_tier)
    and the neutral value of a field not implemented (penalties 0, an empty logit_bias, echo false), which clients
    such as SDKs with defaults send on every request."""
    harmless = {
        "user": "u-1",
        "metadata": {"run": "7"},
        "store": False,
        "service_tier": "auto",
        "frequency_penalty": 0,
        "presence_penalty": 0.0,
        "logit_bias": {},
        "echo": False,
        "best_of": 1,
        "skip_special_tokens": True,
        "response_format": {"type": "text"},
        "stream_options": None,
        "top_p": 1,
        "temperature": 2,  # OpenAI's upper bound is in range
    }
    r = httpx.post(f"{fake_url}/completions", json={"prompt": TOKENS, "max_tokens": 3, **harmless}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def test_the_field_tables_do_not_overlap():
    """Guards against a field listed as honoured and as refused (or ignored) at once: one table decides each field."""
    from nanoserve.ext.server.app import CHAT_HONOURED, COMPLETION_HONOURED, IGNORED, NOT_IMPLEMENTED, RANGES

    honoured = set(CHAT_HONOURED) | set(COMPLETION_HONOURED)
    assert (
        not honoured & set(IGNORED) and not honoured & set(NOT_IMPLEMENTED) and not set(IGNORED) & set(NOT_IMPLEMENTED)
    )
    assert set(RANGES) <= honoured | set(NOT_IMPLEMENTED)


def test_every_field_of_the_openai_client_is_in_a_table():
    """Guards against a field of OpenAI's API that nobody classified (refused as unknown, though OpenAI documents it):
    every parameter the installed `openai` client can send is honoured, ignorable, or listed as not implemented. A
    newer client with a new field fails here until the field is put in one of the tables."""
    import openai.types.chat.completion_create_params as chat_params
    import openai.types.completion_create_params as completion_params

    from nanoserve.ext.server.app import CHAT_HONOURED, COMPLETION_HONOURED, IGNORED, NOT_IMPLEMENTED

    for params, honoured in ((chat_params, CHAT_HONOURED), (completion_params, COMPLETION_HONOURED)):
        names = set(params.CompletionCreateParamsBase.__annotations__) | {"stream"}
        assert names <= set(honoured) | set(IGNORED) | set(NOT_IMPLEMENTED), names - set(honoured) - set(IGNORED)


# ---- the context length --------------------------------------------------------------------------------------------
def test_prompt_plus_max_tokens_beyond_the_context_is_a_400_with_the_numbers(fake_url):
    """Guards against a request over the context being cut silently at "length": vLLM's 400 with the numbers, naming
    max_tokens (the prompt fits; the completion overflows); one that fits exactly is served."""
    prompt = list(range(3, 3 + FAKE_MAX_MODEL_LEN - 10))  # 54 tokens
    with pytest.raises(openai.BadRequestError) as e:
        client_for(fake_url).completions.create(model=MODEL, prompt=prompt, max_tokens=11)
    assert e.value.param == "max_tokens"
    assert f"maximum context length is {FAKE_MAX_MODEL_LEN} tokens" in e.value.message
    assert "you requested 65 tokens (54 in the prompt, 11 in the completion)" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # a one-token prompt and a huge max_tokens: not the prompt's fault
        client_for(fake_url).completions.create(model=MODEL, prompt=[5], max_tokens=1_000_000)
    assert e.value.param == "max_tokens" and "(1 in the prompt, 1000000 in the completion)" in e.value.message
    fits = client_for(fake_url).completions.create(model=MODEL, prompt=prompt, max_tokens=10)
    assert fits.usage.completion_tokens == 10 and fits.choices[0].finish_reason == "length"


def test_chat_over_the_context_names_the_field_at_fault(served):
    """Guards against the chat form of the context check counting the wrong prompt (the template's, not the raw
    text) or the wrong max_tokens (max_completion_tokens is chat's newer name), and against naming the messages when
    it is the completion that overflows: the field named is the one the client gave, or the messages where they alone
    fill the context."""
    base_url, tokenizer = served
    chat_text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    num_prompt = len(tokenizer.encode(chat_text, add_special_tokens=False))
    for name in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as e:
            client_for(base_url).chat.completions.create(model=MODEL, messages=MESSAGES, **{name: 500})
        assert e.value.param == name
        numbers = f"you requested {num_prompt + 500} tokens ({num_prompt} in the messages, 500 in the completion)"
        assert "maximum context length is 512 tokens" in e.value.message and numbers in e.value.message
    long = [{"role": "user", "content": "apple " * 600}]  # the messages alone are past 512 tokens
    for kwargs in ({"max_tokens": 5}, {}):
        with pytest.raises(openai.BadRequestError) as e:
            client_for(base_url).chat.completions.create(model=MODEL, messages=long, **kwargs)
        assert e.value.param == "messages"


# ---- chat messages in every form of the chat API ----------------------------------------------------------------
def test_content_parts_equal_string_content(served):
    """Guards against content parts reaching the template as a list (rendered as its Python repr) or in the wrong
    order: text parts are joined by newlines, as vLLM does, and answer exactly as the joined string does."""
    base_url, _ = served
    client = client_for(base_url)
    parts = [{"type": "text", "text": "Name three"}, {"type": "text", "text": "colors."}]
    as_parts = client.chat.completions.create(messages=[{"role": "user", "content": parts}], **GREEDY)
    as_text = client.chat.completions.create(messages=[{"role": "user", "content": "Name three\ncolors."}], **GREEDY)
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens
    system = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}]
    one_part = client.chat.completions.create(messages=system + MESSAGES, **GREEDY)
    string = client.chat.completions.create(messages=[{"role": "system", "content": "Be brief."}, *MESSAGES], **GREEDY)
    assert one_part.choices[0].message.content == string.choices[0].message.content


def test_names_tool_calls_and_tool_turns_reach_the_template(served):
    """Guards against refusing a conversation the chat API allows: a user's name, an assistant turn that made tool
    calls (content null), and the tool's answer. The template gets them as transformers expects (null content as
    ""), so the prompt is exactly what apply_chat_template makes of them."""
    base_url, tokenizer = served
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": "What is the weather in Paris?", "name": "ada"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "Sunny, 21 C", "tool_call_id": "call_1"},
    ]
    reply = client_for(base_url).chat.completions.create(messages=messages, **GREEDY)
    assert reply.choices[0].message.content
    as_engine_sees = [messages[0], {**messages[1], "content": ""}, messages[2]]
    chat_text = tokenizer.apply_chat_template(as_engine_sees, tokenize=False, add_generation_prompt=True)
    assert reply.usage.prompt_tokens == len(tokenizer.encode(chat_text, add_special_tokens=False))


# ---- logprob bytes ----------------------------------------------------------------------------------------------
def test_byte_table_is_gpt2s():
    """Guards against a typo in the byte-level table: it inverts transformers' own bytes_to_unicode."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from nanoserve.ext.server.app import BYTE_OF_CHAR

    assert BYTE_OF_CHAR == {char: byte for byte, char in bytes_to_unicode().items()}


def test_token_bytes_join_to_the_text(served):
    """Guards against each token's bytes being those of its decoded text, U+FFFD where a character spans tokens
    (an emoji, CJK, a flag): the bytes of all tokens, joined, are the text's UTF-8."""
    from nanoserve.ext.server.app import token_bytes

    _, tokenizer = served
    for text in ("Hi 😀 你好世界", " über 🇫🇷 naïve", "<|im_end|> tabs\tand\nnewlines"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(token_bytes(tokenizer, i) for i in ids) == text.encode()


@pytest.mark.parametrize("request_text", ["Translate to Chinese: Hello world", "Write three emoji."])
def test_logprob_bytes_join_to_the_reply(served, request_text):
    """Guards against the served bytes being per-token decoded text: a greedy reply with CJK or emoji, its chosen
    tokens' bytes joined and decoded, is its content, and each top alternative carries bytes too."""
    base_url, _ = served
    reply = client_for(base_url).chat.completions.create(
        messages=[{"role": "user", "content": request_text}],
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
        **{**GREEDY, "max_tokens": 24},
    )
    content = reply.choices[0].message.content
    entries = reply.choices[0].logprobs.content
    assert any(ord(c) > 127 for c in content), f"the reply has no emoji or CJK to check: {content!r}"
    assert b"".join(bytes(e.bytes) for e in entries).decode(errors="replace") == content
    for e in entries:  # greedy: the most likely alternative is the chosen token, bytes and all
        assert e.top_logprobs[0].bytes == e.bytes


# ---- penalties and bias, honoured as the offline engine does ---------------------------------------------------------
def test_logit_bias_and_penalties_change_the_reply_as_offline(served):
    """Guards against penalties or a bias accepted and ignored, or applied differently from the offline engine: +100
    on a token makes every greedy token that token; a frequency, presence and repetition penalty on a repetitive
    greedy answer changes it, and the served tokens equal LLM.generate's with the same SamplingParams."""
    from nanoserve import LLM, SamplingParams

    base_url, tokenizer = served
    client = client_for(base_url)
    prompt = "Repeat after me five times: apple apple apple apple apple"
    forced = tokenizer.encode(" banana")[0]
    biased = client.completions.create(prompt=prompt, logit_bias={str(forced): 100}, **{**GREEDY, "max_tokens": 4})
    assert biased.choices[0].text == tokenizer.decode([forced] * 4)
    penalties = {"frequency_penalty": 1.5, "presence_penalty": 0.5}
    plain = client.completions.create(prompt=prompt, **{**GREEDY, "max_tokens": 16})
    served_reply = client.completions.create(
        prompt=prompt, extra_body={"repetition_penalty": 1.3}, **penalties, **{**GREEDY, "max_tokens": 16}
    )
    assert served_reply.choices[0].text != plain.choices[0].text
    llm = LLM(max_model_len=512, num_kvcache_blocks=64)
    offline = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3, **penalties))
    llm.close()
    assert served_reply.choices[0].text == offline[0].outputs[0].text


# ---- echo: the prompt's log-likelihood, as evaluation harnesses score choices ----------------------------------------
def test_echo_with_logprobs_equals_transformers_log_softmax(served):
    """Guards against echo being ignored (a harness scoring choices by their log-likelihood would read zeros) or its
    logprobs shifted by a position: echo=True, logprobs=2, max_tokens=0 returns the prompt's text and tokens, None for
    the first token and then each token's logprob equal to transformers' log-softmax over the prompt, the top-2 among
    them, and text offsets that index the text; with max_tokens=1 the completion's one token follows."""
    import torch
    from conftest import default_model_or_skip
    from transformers import AutoModelForCausalLM

    base_url, tokenizer = served
    prompt = "The capital of France is Paris. The capital of Italy is"
    ids = tokenizer.encode(prompt)
    client = client_for(base_url)
    echoed = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    choice = echoed.choices[0]
    assert choice.text == tokenizer.decode(ids) and echoed.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) and logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    hf = AutoModelForCausalLM.from_pretrained(default_model_or_skip(), dtype=torch.float32)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    for position in range(1, len(ids)):
        assert abs(logprobs.token_logprobs[position] - expected[position - 1, ids[position]].item()) < 1e-3
        assert len(logprobs.top_logprobs[position]) <= 3  # the top 2, and the token itself where it is not among them
    assert all(choice.text[o:].startswith(t) for o, t in zip(logprobs.text_offset, logprobs.tokens, strict=True))
    one = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0)
    assert one.choices[0].text.startswith(choice.text) and len(one.choices[0].logprobs.tokens) == len(ids) + 1
    assert one.choices[0].logprobs.token_logprobs[1:-1] == pytest.approx(logprobs.token_logprobs[1:], abs=1e-4)


def test_vllm_prompt_logprobs_field_equals_offline_prompt_logprobs(served):
    """Guards against vLLM's prompt_logprobs extra being refused or returned shifted: on both endpoints, each choice's
    prompt_logprobs has None for the first prompt token, then per token a dict by token id (the top 2 and the token
    itself) of {logprob, decoded_token}, equal to the offline engine's RequestOutput.prompt_logprobs."""
    from nanoserve import LLM, SamplingParams

    base_url, tokenizer = served
    llm = LLM(max_model_len=512, num_kvcache_blocks=64)
    asked = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    prompt = "The capital of France is"
    completion = httpx.post(
        f"{base_url}/completions", json={"prompt": prompt, **GREEDY, "max_tokens": 1, "prompt_logprobs": 2}
    ).json()
    chat = httpx.post(
        f"{base_url}/chat/completions", json={"messages": MESSAGES, **GREEDY, "max_tokens": 1, "prompt_logprobs": 2}
    ).json()
    expected = [llm.generate(prompt, asked)[0], llm.chat(MESSAGES, asked)[0]]
    llm.close()
    for reply, offline in zip((completion, chat), expected, strict=True):
        served_entries = reply["choices"][0]["prompt_logprobs"]
        assert served_entries[0] is None and len(served_entries) == len(offline.prompt_token_ids)
        pairs = zip(served_entries[1:], offline.prompt_logprobs[1:], offline.prompt_token_ids[1:], strict=True)
        for entry, want, token in pairs:
            assert str(token) in entry and len(entry) <= 3
            assert {int(t): e["logprob"] for t, e in entry.items()} == pytest.approx(want, abs=1e-4)
            assert entry[str(token)]["decoded_token"] == tokenizer.decode(token)


# ---- the API key ----------------------------------------------------------------------------------------------------
def test_api_key_is_enforced_on_v1_only():
    """Guards against an API key that can be skipped or guessed at: every /v1 request without it or with a wrong one
    is a 401 in OpenAI's shape (the official client raises AuthenticationError); with it, 200; /health stays open
    for load balancers."""
    from conftest import FakeEngine

    from nanoserve.ext.server.app import ServerConfig, serve_in_background

    fake = FakeEngine(num_blocks=16, block_size=16, max_model_len=FAKE_MAX_MODEL_LEN)
    with serve_in_background(fake.llm, config=ServerConfig(api_key=API_KEY)) as base_url:
        for key in ("wrong", API_KEY + "x", API_KEY[:-1]):
            with pytest.raises(openai.AuthenticationError):
                client_for(base_url, key).completions.create(model=MODEL, prompt=TOKENS, max_tokens=2)
            with pytest.raises(openai.AuthenticationError):
                client_for(base_url, key).models.list()
        for path in ("/models", "/completions", "/chat/completions"):
            r = httpx.request("GET" if path == "/models" else "POST", base_url + path, json={}, timeout=30)
            assert r.status_code == 401, path
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        client = client_for(base_url, API_KEY)
        assert [m.id for m in client.models.list()] == [MODEL]
        assert client.completions.create(model=MODEL, prompt=TOKENS, max_tokens=2).usage.completion_tokens == 2
        assert httpx.get(base_url.removesuffix("/v1") + "/health", timeout=30).status_code == 200


def test_the_server_freezes_its_heap_and_unfreezes_it_at_exit():
    """Guards the server's freeze_heap: after it, the full collection has nothing of start-up's to walk (the objects
    are frozen), and at exit they are unfrozen, so the process ends cleanly (no extension reports objects leaked)."""
    import subprocess
    import sys

    code = (
        "import gc, torch, triton; from nanoserve.ext.server.app import freeze_heap; freeze_heap(); "
        "assert gc.get_freeze_count() > 10000 and not gc.get_objects(), gc.get_freeze_count()"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "leaked" not in done.stderr, done.stderr[-2000:]


def test_api_key_from_the_environment(monkeypatch):
    """Guards against NANOSERVE_API_KEY being read too early or not at all: the command line takes it where
    --api-key is not given, and --api-key wins over it."""
    from nanoserve.ext.server import app as server

    configs = []

    class Stop(Exception):
        pass

    def capture(engine, config):
        configs.append(config)
        raise Stop

    monkeypatch.setattr(server, "LLM", lambda *args, **kwargs: None)
    monkeypatch.setattr(server, "build_app", capture)
    monkeypatch.setenv("NANOSERVE_API_KEY", "from-env")
    for argv, expected in (([], "from-env"), (["--api-key", "from-flag"], "from-flag")):
        with pytest.raises(Stop):
            server.main(argv)
        assert configs[-1].api_key == expected


# ---- the console command ------------------------------------------------------------------------------------------
def test_console_command_hands_its_flags_to_the_server(monkeypatch):
    """Guards against `nanoserve serve MODEL --flags` and `python -m nanoserve.ext.server --model MODEL --flags`
    drifting apart: the command only moves the model into --model."""
    from nanoserve.ext.server import app as server
    from nanoserve.ext.server import cli

    seen = []
    monkeypatch.setattr(server, "main", lambda flags, prog: seen.append(flags))
    cli.main(["serve", "some/model", "--port", "8001", "--api-key", "k"])
    cli.main(["serve", "--max-model-len", "1024", "--no-enable-prefix-caching"])
    assert seen == [
        ["--model", "some/model", "--port", "8001", "--api-key", "k"],
        ["--max-model-len", "1024", "--no-enable-prefix-caching"],
    ]
    for argv in ([], ["run"]):
        with pytest.raises(SystemExit, match="usage: nanoserve serve"):
            cli.main(argv)


def test_console_command_flags_parse():
    """Guards against the flags vLLM users type not existing: each parses in the server's own parser (--help)."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "nanoserve.ext.server.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: nanoserve serve ")
    for flag in (
        "--host",
        "--port",
        "--api-key",
        "--served-model-name",
        "--max-model-len",
        "--gpu-memory-utilization",
        "--tensor-parallel-size",
        "--max-num-seqs",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
    ):
        assert flag in r.stdout, flag


# ---- what clients send by default: guidellm's continuous usage, vLLM's extra sampling fields ----------------------
def guidellm_stream(url: str, body: dict) -> list[dict]:
    """The events of a streamed request as guidellm sends it (its request handlers: include_usage and vLLM's
    continuous_usage_stats, stop null, ignore_eos), without [DONE]."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    full = {"model": MODEL, "stream": True, "stream_options": options, "stop": None, "ignore_eos": True, **body}
    with httpx.stream("POST", url, json=full, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    import json

    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


def check_continuous_usage(events: list[dict], num_prompt: int, max_tokens: int) -> None:
    """Every chunk with a choice carries its usage so far: the prompt's tokens, the completion's growing to
    max_tokens, and their total; then the usage chunk (no choices) with the same final numbers."""
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == max_tokens
    counts = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == max_tokens, counts
    for chunk in chunks:
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == num_prompt == last["usage"]["prompt_tokens"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_guidellm_completions_body_gets_usage_in_every_chunk(fake_url):
    """Guards against guidellm failing every request (continuous_usage_stats was a 400) and against the per-chunk
    usage being the request's total or stale: vLLM's rule, each chunk its choice's tokens so far. Without
    include_usage, continuous_usage_stats adds nothing (vLLM's rule too)."""
    events = guidellm_stream(f"{fake_url}/completions", {"prompt": TOKENS, "max_tokens": 6})
    check_continuous_usage(events, len(TOKENS), 6)
    body = {"prompt": TOKENS, "max_tokens": 3, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    with httpx.stream("POST", f"{fake_url}/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and "usage" not in r.read().decode()


def test_guidellm_chat_body_gets_usage_in_every_chunk(served):
    """The chat form of guidellm's body (content parts, max_completion_tokens): the same usage in every chunk."""
    base_url, tokenizer = served
    messages = [{"role": "user", "content": [{"type": "text", "text": "Name three colors."}]}]
    events = guidellm_stream(f"{base_url}/chat/completions", {"messages": messages, "max_completion_tokens": 5})
    chat_text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    num_prompt = len(tokenizer.encode(chat_text, add_special_tokens=False))
    check_continuous_usage(events, num_prompt, 5)


def test_completions_logprobs_zero_has_openais_shape(served):
    """Guards against logprobs 0 returning top_logprobs as a list per token where logprobs 1 returns a dict: both are
    a dict per token (empty for 0), the shape the openai client types."""
    client = client_for(served[0])
    for n in (0, 1):
        logprobs = (
            client.completions.create(prompt="Hello", logprobs=n, **{**GREEDY, "max_tokens": 3}).choices[0].logprobs
        )
        assert len(logprobs.top_logprobs) == 3 and all(
            isinstance(top, dict) and len(top) == n for top in logprobs.top_logprobs
        )
        assert len(logprobs.token_logprobs) == 3


def test_a_client_that_hangs_up_mid_body_leaves_no_traceback(fake_url):
    """Guards against starlette's ClientDisconnect, raised when a client hangs up while its body is being read, being
    logged as "Exception in ASGI application" with a traceback: it is an ordinary disconnect. The server serves on."""
    import logging
    import socket
    import time
    from urllib.parse import urlparse

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addHandler(handler)
    try:
        address = urlparse(fake_url)
        with socket.create_connection((address.hostname, address.port)) as sock:
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            sock.sendall(head + b'Content-Length: 1000\r\n\r\n{"prompt": [5, 6')
            time.sleep(0.3)  # the handler is reading the body
        time.sleep(0.5)  # the disconnect reaches the handler
    finally:
        uvicorn_log.removeHandler(handler)
    assert not [r for r in records if r.levelno >= logging.ERROR], [r.getMessage() for r in records]
    fits = client_for(fake_url).completions.create(model=MODEL, prompt=TOKENS, max_tokens=2)
    assert fits.usage.completion_tokens == 2


def test_vllm_sampling_fields_are_served_as_offline(served):
    """Guards against vLLM's extra body fields allowed_token_ids, bad_words and truncate_prompt_tokens being refused
    (vLLM's server takes them) or served differently from the offline engine: each reply equals LLM.generate's with
    the same SamplingParams, and each changes the plain reply."""
    from nanoserve import LLM, SamplingParams

    base_url, tokenizer = served
    client = client_for(base_url)
    prompt = "The capital of France is Paris. The capital of Germany is"
    allowed = tokenizer.encode(" Berlin Munich Hamburg.")
    extras = [{"allowed_token_ids": allowed}, {"bad_words": ["The"]}, {"truncate_prompt_tokens": 4}]
    plain = client.completions.create(prompt=prompt, **GREEDY).choices[0].text
    llm = LLM(max_model_len=512, num_kvcache_blocks=64)
    for extra in extras:
        reply = client.completions.create(prompt=prompt, extra_body=extra, **GREEDY)
        offline = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, **extra), use_tqdm=False)
        assert reply.choices[0].text == offline[0].outputs[0].text != plain, extra
        if "truncate_prompt_tokens" in extra:
            assert reply.usage.prompt_tokens == 4
    llm.close()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt=prompt, extra_body={"allowed_token_ids": []}, **GREEDY)
    assert e.value.param == "allowed_token_ids"


@pytest.mark.parametrize(
    "flags, field",
    [
        ({"enable_auto_tool_choice": True}, "enable_auto_tool_choice"),  # vLLM's rule: the pair, or neither
        ({"enable_auto_tool_choice": True, "tool_call_parser": "mistral"}, "tool_call_parser"),
        ({"enable_auto_tool_choice": "yes", "tool_call_parser": "hermes"}, "enable_auto_tool_choice"),
    ],
)
def test_tool_flags_are_checked_before_the_engine_starts(flags, field):
    from conftest import refused

    from nanoserve.ext.server.app import ServerConfig

    refused(field, ServerConfig, **flags)
    assert ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes").tool_parser is not None


# ---- stream_options and --lora-modules, as vLLM takes them (issue 44) ----------------------------------------------
@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
@pytest.mark.parametrize(
    "options", [{"include_usage": True}, {"include_usage": False}, {"continuous_usage_stats": True}]
)
def test_stream_options_without_a_stream_are_refused(fake_url, endpoint, options):
    """Guards against include_usage being silently ignored on a request that does not stream (the client asked for
    usage chunks that never come): OpenAI and vLLM refuse stream_options unless stream is true, and so does nanoserve,
    naming the option, through the official client too. With stream: true, continuous_usage_stats without
    include_usage is accepted and adds nothing, as vLLM does (test_guidellm_completions_body_gets_usage_in_every_chunk
    checks that)."""
    body = {"prompt": TOKENS, "max_tokens": 2} if endpoint == "completions" else {"messages": MESSAGES}
    name = f"stream_options.{next(iter(options))}"
    for stream in ({}, {"stream": False}):
        r = httpx.post(f"{fake_url}/{endpoint}", json={**body, **stream, "stream_options": options}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
    with pytest.raises(openai.BadRequestError) as e:
        client_for(fake_url).completions.create(model=MODEL, prompt=TOKENS, max_tokens=2, stream_options=options)
    assert e.value.param == name
    fits = client_for(fake_url).completions.create(model=MODEL, prompt=TOKENS, max_tokens=2, stream_options=None)
    assert fits.usage.completion_tokens == 2


def test_lora_modules_naming_one_adapter_twice_are_refused_at_start():
    """Guards against `--lora-modules a=P1 a=P2` starting a server whose model name `a` is ambiguous (the second
    adapter silently won): refused by ServerConfig, so the command line fails before any model is loaded, naming
    --lora-modules and the name."""
    from conftest import refused

    from nanoserve.ext.server import app
    from nanoserve.ext.server.app import ServerConfig

    error = refused("lora_modules", ServerConfig, lora_modules=["a=/adapters/one", "a=/adapters/two"])
    assert "'a'" in str(error)
    error = refused("lora_modules", app.main, ["--lora-modules", "a=/adapters/one", "b=/x", "a=/adapters/two"])
    assert "'a'" in str(error)
    assert ServerConfig(lora_modules=["a=/adapters/one", "b=/adapters/two"]).lora_modules == [
        "a=/adapters/one",
        "b=/adapters/two",
    ]
