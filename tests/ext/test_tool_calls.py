"""Tool calls parsed out of the model's text (nanoserve/ext/tool_parsers.py) and served for tool_choice "auto" by a
server started with --enable-auto-tool-choice --tool-call-parser hermes, as vLLM's. The parser is checked on outputs
written by hand (the hermes format: <tool_call>{"name", "arguments"}</tool_call>), streamed piece by piece and whole;
the server on the default model given a chat template that renders tools as Qwen 2.5's does, its output forced to a
tool call's text by a scripted logits processor, through the official openai client (whole and streamed) and with
langchain's tool-result turn as a raw request body. Without the flags, tools without tool_choice mean "none"."""

import json

import pytest
import torch
from conftest import default_model_or_skip

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from nanoserve import LLM  # noqa: E402
from nanoserve.ext.chat import chat_prompts  # noqa: E402
from nanoserve.ext.tool_parsers import HermesToolParser  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# Qwen 2.5's way of offering tools (its chat template, shortened): the tools as JSON in the system turn, the calls and
# their results as hermes blocks
TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call functions. Their signatures:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments }}}
</tool_call>
{%- endfor %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
CALL_TEXT = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# langchain's second turn in an agent loop: the call the model made, its result, and the tools again, no tool_choice
TOOL_RESULT_TURN = [
    *QUESTION,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
]


# ---- the hermes parser, on outputs written by hand ------------------------------------------------------------------
PARSED = [  # (the model's text, the content, the calls as (name, arguments))
    ("Paris is sunny.", "Paris is sunny.", []),
    (CALL_TEXT, "Let me check.\n", [("get_weather", {"city": "Paris"})]),
    (  # two calls on separate lines: the newlines between and after them are no content
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>{"name": "b"}</tool_call>\n',
        "",
        [("a", {"x": 1}), ("b", {})],
    ),
    (  # a block that is no call stays as the model wrote it; text after a call is content
        '<tool_call>{"name": "a"}</tool_call>\nDone. <tool_call>not json</tool_call>',
        "Done. <tool_call>not json</tool_call>",
        [("a", {})],
    ),
    ('Sure <tool_call>\n{"name": "a", "arguments": {"s": "é"}}', "Sure ", [("a", {"s": "é"})]),  # never closed
    ("1 < 2 and <tool", "1 < 2 and <tool", []),  # the start of a block that never comes is content at the end
    # keys in another order: a call by its whole JSON; another key between name and arguments: read at the close
    ('<tool_call>{"arguments": {"x": [1]}, "name": "a"}</tool_call>', "", [("a", {"x": [1]})]),
    ('<tool_call>{"name": "a", "why": "}", "arguments": [2, {}]}</tool_call>', "", [("a", [2, {}])]),
]


@pytest.mark.parametrize("text, content, calls", PARSED)
def test_hermes_parser_whole_and_streamed(text, content, calls):
    """Guards against a call lost or garbled (arguments not a JSON string of what the model wrote), text dropped or
    duplicated around blocks, and a stream whose pieces differ from the whole answer: fed whole, or one character at a
    time (the tail that may start "<tool_call>" held back until it cannot), the parser gives the same content and
    calls, the calls numbered 0, 1, ... with ids of their own; the deltas joined by index are the calls."""
    for pieces in ([text], list(text)):
        parser = HermesToolParser()
        found_content, deltas = "", []
        for i, piece in enumerate(pieces):
            more, new_deltas = parser.feed(piece, final=i == len(pieces) - 1)
            found_content += more
            deltas += new_deltas
        assert found_content == content
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parser.calls] == calls
        assert parser.num_calls == len(calls) and join_deltas(deltas) == parser.calls
        assert all(c["type"] == "function" and c["id"].startswith("call_") for c in parser.calls)
        assert len({c["id"] for c in parser.calls}) == len(calls)


def join_deltas(deltas: list[dict]) -> list[dict]:
    """A stream's tool-call deltas joined as a client joins them, checking their order on the way: a call's first
    delta (its index the next one) has id, type and name, and arguments ""; later ones only a piece of arguments."""
    calls = []
    for delta in deltas:
        if "id" in delta:
            assert delta["index"] == len(calls) and delta["function"]["arguments"] == ""
            calls.append(
                {key: value for key, value in delta.items() if key != "index"} | {"function": {**delta["function"]}}
            )
        else:
            assert set(delta) == {"index", "function"} and delta["index"] == len(calls) - 1
            assert set(delta["function"]) == {"arguments"} and delta["function"]["arguments"]
            calls[-1]["function"]["arguments"] += delta["function"]["arguments"]
    return calls


def test_hermes_parser_streams_the_name_first_then_the_arguments():
    """Guards against a call held back until its block closes (vLLM streams it as it is written): fed a character at
    a time, the call's first delta comes as soon as its name's closing quote does, then an arguments piece per new
    character of the arguments value, none for the call's closing brace or the block's end tag; a quote or bracket
    escaped inside a string does not end the value."""
    text = 'x<tool_call>{"name": "f", "arguments": {"s": "a}\\"]"}}\n</tool_call>'
    parser = HermesToolParser()
    got = []  # (characters fed so far, the deltas that piece brought)
    for i, char in enumerate(text):
        got += [(i + 1, delta) for delta in parser.feed(char, final=i == len(text) - 1)[1]]
    first_at, first = got[0]
    assert text[:first_at].endswith('"f"') and first["function"] == {"name": "f", "arguments": ""}
    arguments = '{"s": "a}\\"]"}'
    assert [delta["function"]["arguments"] for _, delta in got[1:]] == list(arguments)
    assert json.loads(parser.calls[0]["function"]["arguments"]) == {"s": 'a}"]'}


# ---- the server, on the default model with a template that offers tools ---------------------------------------------
class Script:
    """A logits processor (sampler.py's) that makes every sequence write `ids`, then EOS: a model whose output is
    known, so the server's parsing is checked on a real engine, tokenizer and stream."""

    def __init__(self, ids: list[int], eos: int) -> None:
        self.ids = [*ids, eos]

    def needs_tokens_on_host(self) -> bool:
        return False

    def prepare(self, seqs: list) -> "Script.Step":
        # the token being sampled is each sequence's newest (pending) one
        return Script.Step([self.ids[min(seq.num_completion_tokens - 1, len(self.ids) - 1)] for seq in seqs])

    class Step:
        def __init__(self, next_ids: list[int]) -> None:
            self.next_ids = next_ids

        def apply(self, logits: torch.Tensor) -> None:
            rows = torch.arange(len(self.next_ids))
            forced = logits[rows, self.next_ids].clone()
            logits.fill_(float("-inf"))
            logits[rows, self.next_ids] = forced

        def sampled(self, tokens: torch.Tensor) -> None:
            pass


@pytest.fixture(scope="module")
def tools_llm():
    """The default model with Qwen 2.5's way of offering tools as its chat template, scripted to write CALL_TEXT."""
    default_model_or_skip()
    llm = LLM(max_model_len=512, num_kvcache_blocks=64)  # the embedded default model, served under its name
    llm.tokenizer.chat_template = TOOLS_TEMPLATE
    ids = llm.tokenizer.encode(CALL_TEXT)
    assert llm.tokenizer.decode(ids) == CALL_TEXT
    llm.logits_processors["script"] = Script(ids, sorted(llm.eos_token_ids)[0])
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def auto_url(tools_llm):
    from nanoserve.ext.server.app import ServerConfig, serve_in_background

    config = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    with serve_in_background(tools_llm, config) as base_url:
        yield base_url


def client_for(base_url: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120)


def test_the_template_renders_the_tools(tools_llm):
    """Guards against a test that passes without tools reaching the model: the prompt holds the tool's signature, and
    the tool-result turn renders the call and its result."""
    conversation = [{**message, "content": message["content"] or ""} for message in TOOL_RESULT_TURN]  # as served
    (ids,) = chat_prompts(tools_llm, [conversation], tools=[WEATHER])
    prompt = tools_llm.tokenizer.decode(ids)
    assert json.dumps(WEATHER["function"]["parameters"]["properties"]) in prompt.replace("\n", "")
    assert '"name": "get_weather", "arguments": {"city": "Paris"}' in prompt and "18 C and sunny" in prompt


def test_auto_tool_choice_returns_the_call(auto_url):
    """Guards against the call left in the content (or dropped): with the flags, tools without tool_choice mean
    "auto", and the openai client sees message.tool_calls (its arguments a JSON string of what the model wrote), the
    text before the call as content, and finish_reason "tool_calls"."""
    choice = client_for(auto_url).chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER]).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check.\n"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_auto_tool_choice_streams_as_vllm_streams(auto_url):
    """Guards against a stream that leaks the <tool_call> text as content or never sends the call: content deltas
    until the block starts, then the call's first delta (index, id, type, name), then its arguments in pieces as the
    tokens come, then finish_reason "tool_calls"; the deltas join to the whole answer's content and call."""
    stream = client_for(auto_url).chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice="auto", stream=True
    )
    content, deltas, reasons = "", [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        deltas += [call.model_dump(exclude_none=True) for call in delta.tool_calls or []]
        reasons.append(chunk.choices[0].finish_reason)
    assert content == "Let me check.\n" and "<tool" not in content
    (call,) = join_deltas(deltas)  # the name first, then the arguments in several pieces, as vLLM streams them
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_") and len(deltas) > 2
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}


def test_langchains_tool_result_turn(tools_llm, auto_url):
    """Guards against the turn every agent loop makes after a call (tools sent again, no tool_choice) being refused:
    vLLM's server treats a missing tool_choice as "none" unless started with the flags, so a plain server answers it
    as text (the scripted text, <tool_call> and all, as content), and the flagged one parses it."""
    from nanoserve.ext.server.app import serve_in_background

    body = {"model": MODEL, "messages": TOOL_RESULT_TURN, "tools": [WEATHER]}
    with serve_in_background(tools_llm) as plain_url:
        r = httpx.post(f"{plain_url}/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["content"] == CALL_TEXT and "tool_calls" not in message
    r = httpx.post(f"{auto_url}/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"][0]["function"]["name"] == (
        "get_weather"
    )


def test_tool_choice_none_and_length_on_the_flagged_server(tools_llm, auto_url):
    """Guards against "none" being overridden by the flags (the call stays text), and against a call cut by
    max_tokens claiming finish_reason "tool_calls": an unclosed block that is not yet a call is content, "length"."""
    client = client_for(auto_url)
    choice = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice="none")
    assert choice.choices[0].message.content == CALL_TEXT and choice.choices[0].message.tool_calls is None
    ids = tools_llm.tokenizer.encode(CALL_TEXT)
    cut_at = next(k for k in range(len(ids)) if '"name": "get' in tools_llm.tokenizer.decode(ids[:k]))  # in the JSON
    for stream in (False, True):
        reply = client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=[WEATHER], max_tokens=cut_at, stream=stream
        )
        chunks = list(reply) if stream else [reply]
        content = "".join((c.choices[0].delta if stream else c.choices[0].message).content or "" for c in chunks)
        assert content == tools_llm.tokenizer.decode(ids[:cut_at]) and chunks[-1].choices[0].finish_reason == "length"
        assert not any((c.choices[0].delta if stream else c.choices[0].message).tool_calls for c in chunks)
