"""The APIs that agents speak, each driven by the client its users run against a server started here on 127.0.0.1:
OpenAI's Responses API (nanoserve/ext/responses_api.py) through the official `openai` client and an OpenAI Agents SDK
agent, Anthropic's Messages API (nanoserve/ext/messages_api.py) through the official `anthropic` client, and vLLM's
tokenizer endpoints (tokens.py) against transformers' tokenizer. Two servers: the default model (greedy text, which
must equal what /v1/chat/completions returns for the same conversation, and forced tool calls), and a tiny random
model with a byte-level tokenizer and a chat template that offers tools (Qwen 2.5's way), scripted to write a hermes
tool call, or, once a tool's result is in its prompt, a final answer, and served with --enable-auto-tool-choice
--tool-call-parser hermes. Every malformed body is a 400 or 404 naming its field, in the API's error shape, and the
server serves on."""

import asyncio
import json
import shutil
import threading
import time

import pytest
import torch
from conftest import TINY, default_model_or_skip, extension_or_skip

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from nanoserve import LLM  # noqa: E402
from nanoserve.ext import find  # noqa: E402
from nanoserve.ext.server.app import ServerConfig, serve_in_background  # noqa: E402

# The Responses and Messages APIs are extensions of the server's own: their tests skip where they are deleted
API_EXTENSIONS = {"/v1/responses": "responses_api", "/v1/messages": "messages_api"}
needs_responses = pytest.mark.skipif(find("responses_api") is None, reason="ext/responses_api.py is not installed")
needs_messages = pytest.mark.skipif(find("messages_api") is None, reason="ext/messages_api.py is not installed")


def skip_unless_mounted(path: str) -> None:
    """Skips the calling test where path belongs to an API extension that is not installed."""
    if path in API_EXTENSIONS:
        extension_or_skip(API_EXTENSIONS[path])


MODEL = "SmolLM2-135M-Instruct"  # the default model's served name
MAX_TOKENS = 6
QUESTION = "Name three colors."
SYSTEM = "You answer in French."
# the tiny model's script: a tool call (hermes), and the answer it writes once a tool's result is in its prompt
CALL_TEXT = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
FINAL_TEXT = "It is 18 C and sunny in Paris."
LONG_QUESTION = "Talk forever."  # the tiny model's script for it: LONG_TEXT, which takes seconds to write
LONG_TEXT = "la " * 1000
# Faults injected where an extension's per-request work goes wrong (Faults): the text in a prompt that fails its
# request, and the error the failing extension sets (Sequence.error). The request's own fault names a request field,
# as str() of an InvalidField reads; the engine's (an adapter, a kernel) names none
REQUEST_FAULT = "Fail this one: its constraints allow no token."
ENGINE_FAULT = "Fail this one: the adapter broke."
FAULT_ERRORS = {
    REQUEST_FAULT: "structured_outputs: injected: the constraints leave no token to sample",
    ENGINE_FAULT: "injected: the adapter's weights are not finite",
}
ENGINE_FAULT_AFTER = 3  # completion tokens the engine's fault lets out first (the request's fails before any)
WEATHER_QUESTION = "What is the weather in Paris?"
WEATHER_RESULT = "18 C and sunny"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}
# Qwen 2.5's way of offering tools (its chat template, shortened), as tests/ext/test_tool_calls.py has it
TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call functions. Their signatures:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
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


# ---- the servers ----------------------------------------------------------------------------------------------------
class Served:
    def __init__(self, base_url: str, llm: LLM) -> None:
        self.base_url = base_url  # http://127.0.0.1:PORT/v1
        self.root = base_url.removesuffix("/v1")
        self.llm = llm  # only to check the pool
        self.openai = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120)
        self.anthropic = anthropic.Anthropic(base_url=self.root, api_key="x", max_retries=0, timeout=120)

    def chat_text(self, messages: list[dict], max_tokens: int = MAX_TOKENS, **kwargs: object) -> str:
        """What /v1/chat/completions answers, greedy: the reference every other API's text must equal."""
        reply = self.openai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **kwargs
        )
        return reply.choices[0].message.content

    def post(self, path: str, body: object) -> httpx.Response:
        return httpx.post(f"{self.root}{path}", json=body, timeout=120)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.root}/metrics", timeout=30).text
        return {
            name: float(value)
            for name, value in (line.split() for line in text.splitlines() if line and not line.startswith("#"))
        }


@pytest.fixture(scope="module")
def served():
    """The default model, served under its name."""
    default_model_or_skip()
    llm = LLM(max_model_len=512, num_kvcache_blocks=128)
    with serve_in_background(llm) as base_url:
        yield Served(base_url, llm)
    llm.close()


class Script:
    """A logits processor (sampler.py's) that makes every sequence write CALL_TEXT, or FINAL_TEXT where its prompt
    holds a tool's result (LONG_TEXT where it holds LONG_QUESTION), then EOS: a model whose output is known, so that
    the server's translation of tool calls is checked on a real engine, tokenizer and stream."""

    def __init__(self, tokenizer: object, eos: int) -> None:
        self.tokenizer = tokenizer
        self.eos = eos
        self.scripts: dict[int, list[int]] = {}  # seq_id -> the ids it writes

    def needs_tokens_on_host(self) -> bool:
        return False

    def prepare(self, seqs: list) -> "Script.Step":
        next_ids = []
        for seq in seqs:
            if seq.seq_id not in self.scripts:
                prompt = self.tokenizer.decode(seq.token_ids[: seq.num_prompt_tokens])
                text = CALL_TEXT
                if "<tool_response>" in prompt:
                    text = FINAL_TEXT
                if LONG_QUESTION in prompt:
                    text = LONG_TEXT
                self.scripts[seq.seq_id] = [*self.tokenizer.encode(text), self.eos]
            ids = self.scripts[seq.seq_id]
            next_ids.append(ids[min(seq.num_completion_tokens - 1, len(ids) - 1)])  # the pending token's
        return Script.Step(next_ids)

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


class Faults:
    """A logits processor that fails the sequences whose prompt holds a fault's text, as an extension whose work on
    one request went wrong does (it sets Sequence.error and skips it; the engine ends that request alone): the
    request's own fault at its first step, before any token; the engine's once ENGINE_FAULT_AFTER tokens are out."""

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        self.errors: dict[int, str | None] = {}  # seq_id -> the error its prompt asks for (None: none)

    def needs_tokens_on_host(self) -> bool:
        return False

    def prepare(self, seqs: list) -> None:
        for seq in seqs:
            if seq.seq_id not in self.errors:
                prompt = self.tokenizer.decode(seq.token_ids[: seq.num_prompt_tokens])
                self.errors[seq.seq_id] = next((e for text, e in FAULT_ERRORS.items() if text in prompt), None)
            error = self.errors[seq.seq_id]
            if error == FAULT_ERRORS[REQUEST_FAULT] or error and seq.num_completion_tokens > ENGINE_FAULT_AFTER:
                seq.error = error


@pytest.fixture(scope="module")
def tiny_tools(tiny_model, tmp_path_factory):
    """A tiny random llama with a byte-level tokenizer (pad, bos, eos, then the 256 bytes: every character of a long
    tool prompt is a token, so its context is 4096) and TOOLS_TEMPLATE as its chat template, scripted."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-tools")
    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY, "max_position_embeddings": 4096}, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {c: i + 3 for i, c in enumerate(alphabet)}
    backend = Tokenizer(models.BPE(vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.save_pretrained(folder)
    llm = LLM(str(folder), device="cpu", max_model_len=4096, num_kvcache_blocks=512, dtype="float32")
    llm.logits_processors["script"] = Script(llm.tokenizer, eos=2)
    llm.logits_processors["faults"] = Faults(llm.tokenizer)
    config = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes", served_model_name=MODEL)
    with serve_in_background(llm, config) as base_url:
        yield Served(base_url, llm)
    llm.close()
    shutil.rmtree(folder, ignore_errors=True)


def check_pool(served: Served) -> None:
    """Every KV block is back in the pool (read once the server is idle: the test's requests have all ended)."""
    metrics = served.metrics()
    assert metrics["nanoserve_kv_blocks_used"] == metrics["nanoserve_running"] == 0, metrics


# ---- the Responses API ----------------------------------------------------------------------------------------------
@needs_responses
def test_responses_text_equals_chat(served):
    """Guards against the Responses API rendering a conversation otherwise than chat does (instructions dropped or
    placed after the input, content parts misread), or reporting other usage: a string input, and a list of items
    with input_text parts and instructions, give chat's greedy text for the same conversation; cut at
    max_output_tokens, the response is incomplete; a request that names no model is answered by the served one."""
    client = served.openai
    plain = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=MAX_TOKENS, temperature=0)
    assert plain.output_text == served.chat_text([{"role": "user", "content": QUESTION}])
    assert plain.status == "incomplete" and plain.incomplete_details.reason == "max_output_tokens"
    assert plain.usage.output_tokens == MAX_TOKENS and plain.usage.input_tokens > 0
    (message,) = plain.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    items = [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    with_instructions = client.responses.create(
        model=MODEL, input=items, instructions=SYSTEM, max_output_tokens=MAX_TOKENS, temperature=0
    )
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    assert with_instructions.output_text == served.chat_text(chat) != plain.output_text
    assert (
        plain.model
        == MODEL
        == served.post("/v1/responses", {"input": QUESTION, "max_output_tokens": 1}).json()["model"]
    )
    check_pool(served)


@needs_responses
def test_responses_stream_has_the_event_sequence(served):
    """Guards against a stream the openai client cannot follow (events out of order, a missing .added or .done,
    sequence numbers that repeat) or that differs from the whole response: the Responses event sequence for one
    message, numbered 0, 1, 2, ..., its deltas joining to the text of the whole response, which the last event
    carries."""
    client = served.openai
    events = list(
        client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=MAX_TOKENS, temperature=0, stream=True)
    )
    kinds = [event.type for event in events]
    head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[:4] == head and kinds[-4:] == [*tail, "response.incomplete"], kinds
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    whole = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=MAX_TOKENS, temperature=0)
    assert text == events[-1].response.output_text == events[-4].text == whole.output_text
    assert events[-1].response.usage.output_tokens == MAX_TOKENS
    check_pool(served)


@needs_responses
def test_previous_response_id_continues_the_conversation(served):
    """Guards against a second turn that forgets the first (or repeats its instructions, which OpenAI does not carry
    over): previous_response_id gives chat's text for user, assistant, user; retrieve returns the stored response;
    store false keeps nothing, and an id not kept is a 404 naming it."""
    client = served.openai
    first = client.responses.create(
        model=MODEL, input=QUESTION, instructions=SYSTEM, max_output_tokens=MAX_TOKENS, temperature=0
    )
    second = client.responses.create(
        model=MODEL, input="And three more.", previous_response_id=first.id, max_output_tokens=MAX_TOKENS, temperature=0
    )
    chat = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And three more."},
    ]
    assert second.output_text == served.chat_text(chat)
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    unstored = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=1, store=False)
    for call in (
        lambda: client.responses.retrieve(unstored.id),
        lambda: client.responses.create(model=MODEL, input="x", previous_response_id=unstored.id),
    ):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.param in ("response_id", "previous_response_id")
    r = served.post("/v1/responses", {"input": "x", "previous_response_id": "resp_nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    check_pool(served)


@needs_responses
def test_responses_json_schema_and_forced_function(served):
    """Guards against text.format and a named tool_choice being ignored: a json_schema format's text parses and
    validates; a named function is a function_call item whose arguments validate against its parameters (whole, and
    streamed as function_call_arguments deltas that join to them)."""
    client = served.openai
    schema_format = {"type": "json_schema", "name": "weather", "schema": WEATHER_SCHEMA, "strict": True}
    reply = client.responses.create(
        model=MODEL, input=WEATHER_QUESTION, text={"format": schema_format}, max_output_tokens=20, temperature=0
    )
    jsonschema.validate(json.loads(reply.output_text), WEATHER_SCHEMA)
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA, "strict": True}
    forced = {"model": MODEL, "input": WEATHER_QUESTION, "tools": [tool], "max_output_tokens": 20, "temperature": 0}
    forced["tool_choice"] = {"type": "function", "name": "get_weather"}
    (call,) = client.responses.create(**forced).output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    events = list(client.responses.create(**forced, stream=True))
    deltas = "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta")
    (done,) = [event for event in events if event.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments == events[-1].response.output[0].arguments == call.arguments
    check_pool(served)


def test_chat_streams_a_forced_tool_call(served):
    """Guards against the chat stream that the Responses and Messages APIs read for a forced call (it used to be
    refused): the first chunk names the call (index 0, id, type, name), the others carry arguments only; joined, they
    are the whole answer's call."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}
    body = {
        "messages": [{"role": "user", "content": WEATHER_QUESTION}],
        "tools": [tool],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 20,
        "temperature": 0,
    }
    whole = served.openai.chat.completions.create(model=MODEL, **body).choices[0].message.tool_calls[0]
    chunks = list(served.openai.chat.completions.create(model=MODEL, stream=True, **body))
    deltas = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and all(d.index == 0 for d in deltas)
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments for d in deltas) == whole.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@needs_responses
def test_responses_function_call_turns(tiny_tools):
    """Guards against the tool-call turn the Agents SDK makes being lost in translation: with tools and the server's
    parser, the model's hermes call is a function_call item (its arguments what the model wrote) after a message with
    the text before it, whole and streamed; the next turn, the call and its function_call_output as input items, ends
    with the model's answer, which saw the result."""
    client = tiny_tools.openai
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA, "strict": False}
    first = client.responses.create(model=MODEL, input=WEATHER_QUESTION, tools=[tool])
    message, call = first.output
    assert message.content[0].text == "Let me check.\n" and first.status == "completed"
    assert (
        call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    )
    events = list(client.responses.create(model=MODEL, input=WEATHER_QUESTION, tools=[tool], stream=True))
    added = [event.item.type for event in events if event.type == "response.output_item.added"]
    arguments = "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta")
    assert added == ["message", "function_call"] and json.loads(arguments) == {"city": "Paris"}
    result = {"type": "function_call_output", "call_id": call.call_id, "output": WEATHER_RESULT}
    items = [{"role": "user", "content": WEATHER_QUESTION}, call.model_dump(exclude_none=True), result]
    second = client.responses.create(model=MODEL, input=items, tools=[tool])
    assert second.output_text == FINAL_TEXT
    # the same turn through previous_response_id: only the new output goes
    chained = client.responses.create(model=MODEL, input=[result], tools=[tool], previous_response_id=first.id)
    assert chained.output_text == FINAL_TEXT
    check_pool(tiny_tools)


@needs_responses
def test_agents_sdk_runs_a_tool_to_completion(tiny_tools):
    """Guards against the OpenAI Agents SDK failing against the server (its default model speaks the Responses API):
    an agent with one function tool, run with Runner.run, calls the tool with the arguments the model wrote, feeds its
    result back, and ends with the model's answer. Tracing is off: nothing leaves the machine."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return WEATHER_RESULT

    client = openai.AsyncOpenAI(base_url=tiny_tools.base_url, api_key="x", max_retries=0, timeout=120)
    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
    agent = agents.Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather], model=model)
    result = asyncio.run(agents.Runner.run(agent, WEATHER_QUESTION, max_turns=3))
    assert calls == ["Paris"] and result.final_output == FINAL_TEXT
    check_pool(tiny_tools)


@needs_responses
def test_responses_store_drops_the_least_recently_used(tiny_tools):
    """Guards against an unbounded store: a server that keeps two responses drops the least recently used (made or
    read) when a third is stored, and the dropped one's id is a 404."""
    config = ServerConfig(max_stored_responses=2, served_model_name=MODEL)
    with serve_in_background(tiny_tools.llm, config) as base_url:
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120)
        ids = [client.responses.create(model=MODEL, input="hi", max_output_tokens=1).id for _ in range(2)]
        client.responses.retrieve(ids[0])  # now the second is the least recently used
        ids.append(client.responses.create(model=MODEL, input="hi", max_output_tokens=1).id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(ids[1])
        assert [client.responses.retrieve(i).id for i in (ids[0], ids[2])] == [ids[0], ids[2]]


@needs_responses
@needs_messages
def test_clients_that_hang_up_are_aborted(tiny_tools):
    """Guards against a request on a new endpoint that runs on after its client went away: a streamed response and a
    streamed message whose clients hang up after their first event, and a whole response whose client gives up, all
    stop within a few steps and leave every block in the pool; the server serves on."""

    before = tiny_tools.metrics()["nanoserve_generated_tokens_total"]
    bodies = [
        ("/v1/responses", {"model": MODEL, "input": LONG_QUESTION, "stream": True}),
        (
            "/v1/messages",
            {"model": MODEL, "max_tokens": 3000, "messages": [{"role": "user", "content": LONG_QUESTION}]},
        ),
    ]
    for path, body in bodies:
        with httpx.stream("POST", f"{tiny_tools.root}{path}", json={**body, "stream": True}, timeout=60) as r:
            assert r.status_code == 200 and next(r.iter_lines()).startswith("event: ")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{tiny_tools.base_url}/responses", json={"model": MODEL, "input": LONG_QUESTION}, timeout=0.5)
    for _ in range(300):  # the aborts take a poll of the connection (0.2 s) and a step
        if tiny_tools.metrics()["nanoserve_running"] == 0:
            break
        time.sleep(0.05)
    check_pool(tiny_tools)
    generated = tiny_tools.metrics()["nanoserve_generated_tokens_total"] - before
    assert generated < len(LONG_TEXT), "a request ran to the end"  # (a byte a token) the three stopped early
    assert tiny_tools.openai.responses.create(model=MODEL, input=WEATHER_QUESTION).output_text == CALL_TEXT


# ---- the Messages API -----------------------------------------------------------------------------------------------
@needs_messages
def test_messages_text_equals_chat(served):
    """Guards against the Messages API rendering a conversation otherwise than chat does (the system prompt dropped,
    text blocks misjoined) or misreporting its end: the same greedy text, whole and streamed (its events in
    Anthropic's order, the deltas joining to the text), stop_reason max_tokens, and chat's token counts."""
    client = served.anthropic
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "system": SYSTEM, "extra_body": {"temperature": 0}}
    blocks = [{"type": "text", "text": QUESTION}]
    reply = client.messages.create(messages=[{"role": "user", "content": blocks}], **body)
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    (block,) = reply.content
    assert block.type == "text" and block.text == served.chat_text(chat)
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == MAX_TOKENS
    with client.messages.stream(messages=[{"role": "user", "content": QUESTION}], **body) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events if event.type != "text"]  # "text": the client's own, per text delta
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert final.content[0].text == block.text and final.usage.input_tokens == reply.usage.input_tokens
    check_pool(served)


@needs_messages
def test_messages_tool_use_and_tool_result(tiny_tools):
    """Guards against Anthropic's tool turns being lost in translation: the model's hermes call is a tool_use block
    (input: the object the model wrote) after the text before it, stop_reason tool_use, whole and streamed (the
    input_json_delta pieces joining to it); the tool_result turn ends with the model's answer, which saw the result."""
    client = tiny_tools.anthropic
    tool = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_SCHEMA}
    question = {"role": "user", "content": WEATHER_QUESTION}
    reply = client.messages.create(model=MODEL, max_tokens=200, messages=[question], tools=[tool])
    text, use = reply.content
    assert text.text == "Let me check.\n" and reply.stop_reason == "tool_use"
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    with client.messages.stream(model=MODEL, max_tokens=200, messages=[question], tools=[tool]) as stream:
        deltas = [event.delta for event in stream if event.type == "content_block_delta"]
        pieces = [delta.partial_json for delta in deltas if delta.type == "input_json_delta"]
        final = stream.get_final_message()
    assert json.loads("".join(pieces)) == {"city": "Paris"} and final.content[1].input == {"city": "Paris"}
    turn = [
        question,
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in reply.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": WEATHER_RESULT}]},
    ]
    answer = client.messages.create(model=MODEL, max_tokens=200, messages=turn, tools=[tool])
    assert answer.content[0].text == FINAL_TEXT and answer.stop_reason == "end_turn"
    check_pool(tiny_tools)


# ---- a request the engine fails alone ------------------------------------------------------------------------------
def fault_body(path: str, text: str, stream: bool) -> dict:
    """A body for path whose prompt is text (max 50 tokens: a script answer is longer)."""
    if path == "/v1/completions":
        return {"model": MODEL, "prompt": text, "max_tokens": 50, "stream": stream}
    if path == "/v1/responses":
        return {"model": MODEL, "input": text, "max_output_tokens": 50, "stream": stream}
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 50, "stream": stream}


def events_of(response: httpx.Response) -> list[tuple[str | None, object]]:
    """A server-sent event stream as (event name, its data parsed; [DONE] as is)."""
    events = []
    name = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append((name, data if data == "[DONE]" else json.loads(data)))
            name = None
    return events


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fault", [REQUEST_FAULT, ENGINE_FAULT])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"])
def test_a_request_the_engine_fails_alone_gets_its_apis_error(tiny_tools, path, fault, stream):
    """Guards against a request an extension failed on (finish reason "error") being answered as a success (a 200 with
    empty or cut text), as a bare 500, or with a hung stream, and against it costing the request beside it: whole, an
    HTTP error in the API's shape (OpenAI's; Anthropic's on /v1/messages) whose status says whose fault it was (the
    request's own: 400, naming the field; the engine's: 500) and whose message says why; streamed, the API's error
    event (chat's error chunk before [DONE], Responses' response.failed after its opening events, Anthropic's error),
    then the end. The request sent beside it gets its whole answer, every block comes back, and the server serves on."""
    skip_unless_mounted(path)
    neighbour = {}

    def send_neighbour() -> None:
        neighbour["text"] = tiny_tools.chat_text([{"role": "user", "content": WEATHER_QUESTION}], max_tokens=200)

    beside = threading.Thread(target=send_neighbour)
    beside.start()
    status = 400
    if fault == ENGINE_FAULT:
        status = 500
    why = FAULT_ERRORS[fault].removeprefix("structured_outputs: ")
    body = fault_body(path, fault, stream)
    if not stream:
        r = tiny_tools.post(path, body)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        if path == "/v1/messages":
            assert r.json()["type"] == "error"
            assert error["type"] == {400: "invalid_request_error", 500: "api_error"}[status]
        else:
            assert error["type"] == {400: "invalid_request_error", 500: "server_error"}[status]
            assert error["param"] == {400: "structured_outputs", 500: None}[status]
        assert why in error["message"]
    else:
        with httpx.stream("POST", f"{tiny_tools.root}{path}", json=body, timeout=60) as r:
            assert r.status_code == 200
            events = events_of(r)
        if path == "/v1/responses":
            assert events[0][0] == "response.created" and events[-1][0] == "response.failed", events
            failed = events[-1][1]["response"]
            assert failed["status"] == "failed" and why in failed["error"]["message"]
            assert failed["error"]["code"] == {400: "invalid_prompt", 500: "server_error"}[status]
            assert [event["sequence_number"] for _, event in events] == list(range(len(events)))
        elif path == "/v1/messages":
            assert events[-1][0] == "error" and why in events[-1][1]["error"]["message"], events
            assert events[-1][1]["error"]["type"] == {400: "invalid_request_error", 500: "api_error"}[status]
        else:
            assert events[-1][1] == "[DONE]", events
            error = events[-2][1]["error"]
            assert why in error["message"]
            assert error["type"] == {400: "invalid_request_error", 500: "server_error"}[status]
        if fault == ENGINE_FAULT and path != "/v1/messages":  # its first tokens went out before it failed
            assert len(events) > 3
    beside.join(timeout=120)
    assert neighbour["text"] == CALL_TEXT
    check_pool(tiny_tools)


def test_a_slow_grammar_parse_stalls_no_stream(tiny_tools, monkeypatch):
    """Guards against per-request work on the event loop: SamplingParams, which parses a response_format's schema into
    a grammar (0.3 s for 20,000 properties on this CPU), is built on the executor. Made to take 2 s here, it must not
    pause a stream already under way (its events keep coming) nor the engine thread."""
    from nanoserve.ext.server import app

    slow_build = 2.0  # seconds

    def slow(*args: object) -> object:
        time.sleep(slow_build)
        return sampling_params(*args)

    sampling_params = app.sampling_params
    body = {"model": MODEL, "messages": [{"role": "user", "content": LONG_QUESTION}], "stream": True}
    with httpx.stream("POST", f"{tiny_tools.base_url}/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)  # the stream is under way
        monkeypatch.setattr(app, "sampling_params", slow)
        slowed = threading.Thread(target=tiny_tools.chat_text, args=([{"role": "user", "content": "hi"}], 1))
        slowed.start()
        arrivals = []
        while slowed.is_alive() or len(arrivals) < 2:
            next(lines)
            arrivals.append(time.monotonic())
        monkeypatch.undo()
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    assert arrivals[-1] - arrivals[0] >= slow_build * 0.9 and max(gaps) < slow_build / 2, max(gaps)
    for _ in range(300):  # the hung-up stream is aborted within a poll and a step
        if tiny_tools.metrics()["nanoserve_running"] == 0:
            break
        time.sleep(0.05)
    check_pool(tiny_tools)


# ---- vLLM's tokenizer endpoints -------------------------------------------------------------------------------------
def test_tokenize_and_detokenize_as_transformers(served):
    """Guards against token counts that differ from what the model gets: /tokenize gives transformers' ids for a
    prompt (with and without special tokens, with each token's string) and for a conversation through the chat
    template, with count and max_model_len; /detokenize gives the text back; /tokenizer_info has what
    lm-evaluation-harness's remote tokenizer reads."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_or_skip())
    prompt = "The capital of France is Paris, état 🌍."
    for special in (True, False):
        r = served.post("/tokenize", {"prompt": prompt, "add_special_tokens": special, "return_token_strs": True})
        ids = tokenizer.encode(prompt, add_special_tokens=special)
        assert r.json() == {
            "count": len(ids),
            "max_model_len": 512,
            "tokens": ids,
            "token_strs": tokenizer.convert_ids_to_tokens(ids),
        }
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    r = served.post("/tokenize", {"model": MODEL, "messages": messages})
    assert r.json()["tokens"] == tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert served.post("/detokenize", {"tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}
    info = httpx.get(f"{served.root}/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == tokenizer.chat_template


# ---- malformed bodies -----------------------------------------------------------------------------------------------
GOOD = {  # a body that is served, per path, to which each case adds or changes fields
    "/v1/responses": {"model": MODEL, "input": QUESTION, "max_output_tokens": 1},
    "/v1/messages": {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": QUESTION}]},
    "/tokenize": {"prompt": QUESTION},
    "/detokenize": {"tokens": [1, 2]},
}
CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
MALFORMED = [  # (path, fields over GOOD's, the status, the field the error names)
    ("/v1/responses", {"input": 5}, 400, "input"),
    ("/v1/responses", {"input": [{"type": "image"}]}, 400, "input[0].type"),
    ("/v1/responses", {"input": ["hi"]}, 400, "input[0].type"),
    (
        "/v1/responses",
        {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
        400,
        "input[0].content[0].type",
    ),
    (
        "/v1/responses",
        {"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]},
        400,
        "input[0].call_id",
    ),
    ("/v1/responses", {"input": [CALL, {"type": "function_call_output", "call_id": "c2"}]}, 400, "input[1].call_id"),
    ("/v1/responses", {"input": [{**CALL, "arguments": {}}]}, 400, "input[0].arguments"),
    ("/v1/responses", {"input": [{"role": "robot", "content": "hi"}]}, 400, "input"),
    ("/v1/responses", {"previous_response_id": "resp_0"}, 404, "previous_response_id"),
    ("/v1/responses", {"previous_response_id": 5}, 400, "previous_response_id"),
    ("/v1/responses", {"model": "gpt-5"}, 404, "model"),
    ("/v1/responses", {"max_output_tokens": "many"}, 400, "max_output_tokens"),
    ("/v1/responses", {"max_output_tokens": 10**6}, 400, "max_output_tokens"),
    ("/v1/responses", {"temperature": 3}, 400, "temperature"),
    ("/v1/responses", {"instructions": ["x"]}, 400, "instructions"),
    ("/v1/responses", {"tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ("/v1/responses", {"tools": "f"}, 400, "tools"),
    ("/v1/responses", {"tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice"),
    ("/v1/responses", {"text": {"format": {"type": "yaml"}}}, 400, "text.format"),
    ("/v1/responses", {"text": {"verbosity": "low"}}, 400, "text.verbosity"),
    ("/v1/responses", {"text": "json"}, 400, "text"),
    ("/v1/responses", {"reasoning": {"effort": "high"}}, 400, "reasoning"),
    ("/v1/responses", {"background": True}, 400, "background"),
    ("/v1/responses", {"include": ["message.output_text.logprobs"]}, 400, "include"),
    ("/v1/responses", {"stream": "yes"}, 400, "stream"),
    ("/v1/responses", {"store": 1}, 400, "store"),
    ("/v1/responses", {"temperatur": 0}, 400, "temperatur"),
    ("/v1/responses", {"input": "x" * 20_000}, 400, "input"),  # over the server's cap on a prompt's characters
    ("/v1/messages", {"max_tokens": None}, 400, "max_tokens"),
    ("/v1/messages", {"max_tokens": -1}, 400, "max_tokens"),
    ("/v1/messages", {"messages": "hi"}, 400, "messages"),
    ("/v1/messages", {"messages": [5]}, 400, "messages[0]"),
    (
        "/v1/messages",
        {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
        400,
        "messages[0].content[0].type",
    ),
    (
        "/v1/messages",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        400,
        "messages[0].content[0].text",
    ),
    (
        "/v1/messages",
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}]},
        400,
        "messages[0].content[0].tool_use_id",
    ),
    ("/v1/messages", {"system": 5}, 400, "system"),
    ("/v1/messages", {"system": [{"type": "image"}]}, 400, "system[0].type"),
    ("/v1/messages", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "tools[0].type"),
    ("/v1/messages", {"tool_choice": {"type": "every"}}, 400, "tool_choice.type"),
    ("/v1/messages", {"tool_choice": {"type": ["auto"]}}, 400, "tool_choice.type"),
    ("/v1/messages", {"stop_sequences": [5]}, 400, "stop_sequences"),
    ("/v1/messages", {"top_k": "all"}, 400, "top_k"),
    ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "thinking"),
    ("/v1/messages", {"model": "claude"}, 404, "model"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "x" * 20_000}]}, 400, "messages"),
    ("/tokenize", {"prompt": "x" * 20_000}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": None}, 400, "prompt"),
    ("/tokenize", {"messages": "hi"}, 400, "messages"),
    ("/tokenize", {"add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"add_generation_prompt": False}, 400, "add_generation_prompt"),
    ("/tokenize", {"model": "gpt-5"}, 404, "model"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "hi"}, 400, "tokens"),
    ("/detokenize", {"prompt": "hi"}, 400, "prompt"),
]


@pytest.mark.parametrize("path, fields, status, param", MALFORMED)
def test_malformed_bodies_are_refused_by_name(served, path, fields, status, param):
    """Guards against a 500 (or a silent default) for a malformed body: each is a 400 or 404 naming the field, in the
    API's error shape (Anthropic's on /v1/messages: the field starts the message), and the server serves on."""
    skip_unless_mounted(path)
    r = served.post(path, {**GOOD[path], **fields})
    assert r.status_code == status, r.text
    if path == "/v1/messages":
        error = r.json()
        assert error["type"] == "error" and error["error"]["message"].startswith(f"{param}: "), error
    else:
        assert r.json()["error"]["param"] == param, r.text
    assert served.post(path, GOOD[path]).status_code == 200


@needs_messages
def test_anthropic_client_sees_errors_in_its_shape(served):
    """Guards against errors the anthropic client cannot read: a bad request is its BadRequestError, whose message
    names the field, and an unknown route under /v1/messages is its NotFoundError."""
    with pytest.raises(anthropic.BadRequestError) as e:
        served.anthropic.messages.create(model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in e.value.message


@needs_responses
@needs_messages
def test_api_key_guards_the_new_routes(served):
    """Guards against an API the key does not cover: with --api-key, each new route needs it (as the openai client
    sends it, or the anthropic client's x-api-key), and both clients get through with it."""
    key = "sk-nanoserve-test"
    with serve_in_background(served.llm, ServerConfig(api_key=key)) as base_url:
        root = base_url.removesuffix("/v1")
        for path, body in GOOD.items():
            assert httpx.post(f"{root}{path}", json=body, timeout=60).status_code == 401
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=root, api_key="wrong", max_retries=0).messages.create(**GOOD["/v1/messages"])
        reply = anthropic.Anthropic(base_url=root, api_key=key, max_retries=0).messages.create(**GOOD["/v1/messages"])
        assert reply.usage.output_tokens == 1
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
        assert client.responses.create(**GOOD["/v1/responses"]).usage.output_tokens == 1
