"""What the server's APIs share: the server's config (ServerConfig), reading a request's body within its caps, checking
a body's fields by name (field, string, check_known), the HTTP status an error answers with (status_of: 400 for bad
input, 404, 500 for the engine's fault), text parts and conversations of items as chat messages (message_text,
chat_messages), other APIs' function tools as chat's (function_tools), and the loop that turns chat's stream of chunks
into another API's events (Translated), sent as server-sent events (event_stream), which end with the API's error
events when the request fails. The OpenAI endpoints and the chat pipeline that every API answers through are in
app.py; the Responses API, the Messages API and the tokenizer endpoints each have a module beside this one, which
imports nothing of theirs."""

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException

from nanoserve.checks import InvalidField, check_flag, check_number, shown
from nanoserve.ext import load

T = TypeVar("T")
LOCALHOST = "127.0.0.1"
DEFAULT_PORT = 8000  # vLLM's default too
TEXT_PARTS = ("text", "input_text", "output_text")  # a text part's type: chat's and Anthropic's, the Responses API's
MAX_JSON_DEPTH = 64  # arrays and objects nested deeper than this get a 400 (OpenAI's bodies nest a few levels)
CLOSE = {"Connection": "close"}  # with a 408 or 413: the rest of the body is never read, so the connection ends
JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string, escaped quotes included
NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
BRACKET_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # opening: +1, closing: -1 (as signed bytes)


@dataclass
class ServerConfig:
    """Where the server listens and under what name, what one request may cost, how long the server waits, and the API
    key (EngineConfig is the engine's): each field is a flag of its own, --host, --port, --max-n, --api-key and so on.
    Every limit must be positive; the port may be 0 (any free one)."""

    host: str = LOCALHOST  # 0.0.0.0 serves every interface
    port: int = DEFAULT_PORT
    served_model_name: str | None = None  # the `model` clients ask for; None: the engine's model (--model)
    max_n: int = 128  # choices one request may ask for (n x prompts); OpenAI allows n <= 128
    # characters of prompt text (all prompts, or all messages), checked before tokenizing; None: PROMPT_CHARS_PER_TOKEN
    # (32) x max_model_len, which English text (4-5 characters a token) cannot approach
    max_prompt_chars: int | None = None
    max_body_bytes: int = 4 * 2**20  # 4 MiB; a larger body gets a 413 (parsing it would stall the event loop)
    body_timeout: float = 30.0  # seconds for a request's body to arrive once its headers have; then a 408
    shutdown_timeout: float = 5.0  # seconds open requests get to finish at shutdown; then they fail
    # every API request (all but /health and /metrics) must send `Authorization: Bearer KEY` or `x-api-key: KEY`
    api_key: str | None = None  # None: no key needed
    # vLLM's pair: tools without tool_choice mean "auto", tool calls parsed out of the text by the parser named
    # (ext/tool_parsers.py: hermes); without them, "none" (the template renders the tools, the answer is text)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # vLLM's --lora-modules name=path ...: LoRA adapters (ext/lora.py) that a request's model field names
    lora_modules: list[str] | None = None
    # /v1/responses keeps this many responses (those with store: true, OpenAI's default) for previous_response_id and
    # GET /v1/responses/{id}, in memory, dropping the least recently used first. Each holds its conversation's text,
    # at most max_body_bytes of input and max_model_len tokens of output per turn (responses.py)
    max_stored_responses: int = 256

    def __post_init__(self) -> None:
        texts = "host served_model_name api_key enable_auto_tool_choice tool_call_parser lora_modules".split()
        for name, value in vars(self).items():
            if name not in texts and value is not None:
                check_number(name, value, low=0, above_low=name != "port")
        check_flag("enable_auto_tool_choice", self.enable_auto_tool_choice)
        # the parser's class, found by name in its extension (ext/tool_parsers.py); None: no parser
        self.tool_parser = None
        if self.tool_call_parser is not None:
            self.tool_parser = load("tool_parsers", "tool_call_parser").parser_for(self.tool_call_parser)
        if self.enable_auto_tool_choice and self.tool_parser is None:
            raise InvalidField("enable_auto_tool_choice", "needs a parser: --tool-call-parser hermes")
        # --lora-modules as name -> path, checked before the engine is made (a typo costs no model load): a name that
        # comes twice would make a request's model ambiguous
        self.adapters = {}
        for module in self.lora_modules or []:
            name, equals, path = str(module).partition("=")
            if not (name and equals and path):
                raise InvalidField("lora_modules", f"{shown(module)} is not name=path")
            if name in self.adapters:
                raise InvalidField("lora_modules", f"names the adapter {shown(name)} twice")
            self.adapters[name] = path


class NotFound(InvalidField):
    """A 404, naming the field whose value names nothing this server has (a model, a stored response)."""


def status_of(error: Exception) -> int:
    """The HTTP status that answers an error: Starlette's own (404: no route, 405, and read_body's 408 and 413), a
    NotFound's 404, other bad input's (a ValueError, InvalidField among them) 400, and anything else, the engine's or
    the server's fault, 500."""
    if isinstance(error, HTTPException):
        return error.status_code
    if isinstance(error, NotFound):
        return 404
    if isinstance(error, ValueError):
        return 400
    return 500


def json_depth(body: bytes) -> int:
    """How deeply arrays and objects nest in a JSON text, counted without recursion (json.loads recurses, and a body
    nested 5,000 deep would exhaust Python's stack). Brackets inside strings do not count; the rest become +1 or -1
    steps, whose running sum is the depth, summed in C (a Python loop would take seconds on a body of brackets)."""
    brackets = JSON_STRING.sub(b"", body).translate(None, NOT_BRACKETS)
    steps = memoryview(brackets.translate(BRACKET_STEPS)).cast("b")  # signed bytes: 0xff is -1
    return max(accumulate(steps), default=0)


async def read_body(http: Request, max_bytes: int) -> bytes:
    """The request's body, refused with a 413 as soon as it is known to be over max_bytes."""
    too_large = HTTPException(413, f"the body is over {max_bytes} bytes", CLOSE)
    if int(http.headers.get("content-length", 0)) > max_bytes:  # the server has checked it is a number
        raise too_large
    body = bytearray()
    async for chunk in http.stream():
        body += chunk
        if len(body) > max_bytes:
            raise too_large
    return bytes(body)


async def read_object(http: Request, config: ServerConfig) -> dict:
    """The body parsed, which must be a JSON object: a 408 if it has not all come within body_timeout, a 413 past
    max_body_bytes, a 400 (param null) if it is not a JSON object or nests deeper than MAX_JSON_DEPTH."""
    try:
        body = await asyncio.wait_for(read_body(http, config.max_body_bytes), config.body_timeout)
    except asyncio.TimeoutError:
        raise HTTPException(408, f"the body did not arrive within {config.body_timeout} s", CLOSE) from None
    if json_depth(body) > MAX_JSON_DEPTH:
        raise ValueError(f"the body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = json.loads(body)
    except ValueError as e:
        raise ValueError(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    return body


def field(body: dict, name: str, kind: type[T], default: T) -> T:
    """body[name] if it is given and not null, refused (InvalidField) unless it is a kind; else default."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise InvalidField(name, f"{value!r} is not a {kind.__name__}")
    return value


def string(item: dict, key: str, where: str = "") -> str:
    """item[key], which must be a string: else an InvalidField naming it where + key (where: the item's name and a
    dot, "input[2].", where item is a part of the body)."""
    if not isinstance(item.get(key), str):
        raise InvalidField(where + key, "is not a string")
    return item[key]


def check_known(body: dict, honoured: list[str], ignored: list[str], not_implemented: dict, prefix: str = "") -> None:
    """Every field of a body (of any API) is honoured, ignorable, or refused by name: unknown, or not implemented yet,
    unless its value asks for nothing (null, or not_implemented's value for it, such as best_of 1). prefix: where the
    body is one field's value, the field's name and a dot (errors name "stream_options.include_obfuscation")."""
    for name, value in body.items():
        if name not in honoured and name not in ignored and name not in not_implemented:
            raise InvalidField(prefix + name, "unrecognized argument (nanoserve/ext/server lists the known fields)")
        if name in not_implemented and value not in (None, not_implemented[name]):
            raise InvalidField(prefix + name, "nanoserve does not implement this field yet")


def message_text(content: list, name: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """A message's content parts as one text, joined by newlines as vLLM does; only text parts can be read (kinds: the
    names text parts have in the API: the Responses API's input_text and output_text)."""
    texts = []
    for j, part in enumerate(content):
        kind = None
        if isinstance(part, dict):
            kind = part.get("type")
        if kind not in kinds:
            raise InvalidField(f"{name}[{j}].type", f"nanoserve does not implement {shown(kind)} parts yet, only text")
        texts.append(string(part, "text", f"{name}[{j}]."))
    return "\n".join(texts)


def normalized(messages: object) -> object:
    """Messages in any form of OpenAI's chat API as the engine takes them: content parts joined into one text, and an
    assistant turn with content null (it made tool_calls) given "" as content. Other keys (name, tool_calls,
    tool_call_id) go to the chat template as they are; the engine checks roles and text, and refuses anything that is
    not a conversation (a list of messages) as "messages"."""
    if not isinstance(messages, list):
        return messages
    out = []
    for i, message in enumerate(messages):
        if isinstance(message, dict):
            content = message.get("content")
            if isinstance(content, list):
                content = message_text(content, f"messages[{i}].content")
            elif content is None and message.get("role") == "assistant":
                content = ""
            message = {**message, "content": content}
        out.append(message)
    return out


def chat_messages(items: list, names: list[str]) -> list[dict]:
    """Items of the Responses API (the Messages API's content blocks are made into them) as chat messages: a message
    as itself (its text parts joined), function_call items as the tool_calls of an assistant message (the one before
    them, if it is the assistant's), a function_call_output (its output a text, or text parts) as a tool message,
    which must follow its call. names: each item's name in errors ("input[2]", "messages[1].content[0]")."""
    messages = []
    call_ids = set()  # of every function_call so far
    for item, name in zip(items, names, strict=True):
        kind = None
        if isinstance(item, dict):
            kind = item.get("type", "message")
        if kind == "message":
            content = item.get("content")
            if isinstance(content, list):
                content = message_text(content, f"{name}.content", TEXT_PARTS)
            messages.append({"role": item.get("role"), "content": content})
        elif kind == "function_call":
            where = f"{name}."  # the start of its fields' names in errors
            call_id = string(item, "call_id", where)
            function = {"name": string(item, "name", where), "arguments": string(item, "arguments", where)}
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append({"id": call_id, "type": "function", "function": function})
            call_ids.add(call_id)
        elif kind == "function_call_output":
            call_id = string(item, "call_id", f"{name}.")
            if call_id not in call_ids:
                raise InvalidField(f"{name}.call_id", f"{shown(call_id)} is no earlier function_call's")
            output = item.get("output")
            if isinstance(output, list):
                output = message_text(output, f"{name}.output", TEXT_PARTS)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            raise InvalidField(f"{name}.type", f"{shown(kind)} is not message, function_call or function_call_output")
    return messages


def function_tools(tools: object, kind: str, schema: str) -> list[dict]:
    """Another API's function tools in chat's shape: each of type `kind` (missing: "custom", Anthropic's), its
    parameters' JSON schema under the key `schema`; a tool of another type (a built-in or server tool) is refused."""
    if not isinstance(tools, list):
        raise InvalidField("tools", "expected a list of tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != kind:
            raise InvalidField(f"tools[{i}].type", f"nanoserve does not implement tools other than {kind} ones yet")
        function = {
            "name": tool.get("name"),
            "description": tool.get("description", ""),
            "parameters": tool.get(schema),
        }
        out.append({"type": "function", "function": function})
    return out


def server_sent(event: dict) -> str:
    """One server-sent event; one with a type (the Responses and Messages APIs' events) is named by it."""
    line = f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
    if "type" in event:
        line = f"event: {event['type']}\n{line}"
    return line


async def event_stream(
    events: AsyncIterator[dict], failed: Callable[[Exception], list[dict]], end: str = ""
) -> AsyncIterator[str]:
    """events as server-sent events, then `end`. A request that fails after the 200 (the engine ended it with an
    error, or shutdown came) ends them with failed(error), the API's error events; the server serves on."""
    try:
        async for event in events:
            yield server_sent(event)
    except (RuntimeError, ValueError) as error:
        for event in failed(error):
            yield server_sent(event)
    yield end


class Translated:
    """An answer in another API's shape, made of chat's stream of one choice (the answer of a body that the API
    translated, with continuous usage), as a list of output items, each a text or a tool call. This class decides when
    an item opens (a text after anything else; a call each time one begins) and closes (when the next opens, or at the
    end), and keeps the open item's text or arguments so far (`text`); a subclass says what the API's events are at
    the answer's start (the first chunk), when an item begins, grows by a piece (delta) and finishes, at the end (the
    finish reason, the usage) and when the request fails (failed), and keeps the answer in `whole`."""

    open: str | None = None  # the kind of the item being written ("text" or "call"); None: none is
    text = ""  # the open item's text, or its call's arguments, so far
    started = False
    whole: dict  # the answer so far; after the last event, the whole answer

    async def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
        """The API's events, from chat's chunks (a stream whose client went away ends before the end's)."""
        finish_reason = None  # the choice's, once it has one
        async for chunk in chunks:
            events = []
            if not self.started:
                events = self.start(chunk)
                self.started = True
            if chunk["choices"]:
                finish_reason = chunk["choices"][0]["finish_reason"]
                events += self.feed(chunk["choices"][0]["delta"])
            else:  # the last chunk: the usage of all
                events += self.switch(None, None) + self.end(finish_reason, chunk["usage"])
            for event in events:
                yield event

    def feed(self, delta: dict) -> list[dict]:
        """The events of one chunk's delta: its text, and its tool calls' beginnings and arguments."""
        events = []
        if delta["content"] and self.open != "text":
            events = self.switch("text", None)
        events += self.add(delta["content"])
        for call in delta.get("tool_calls", []):
            if "id" in call:  # a call begins
                events += self.switch("call", call)
            events += self.add(call["function"]["arguments"])
        return events

    def add(self, piece: str) -> list[dict]:
        """A piece of the open item's text or arguments: its delta events (none for an empty piece)."""
        if not piece:
            return []
        self.text += piece
        return self.delta(piece)

    def switch(self, kind: str | None, call: dict | None) -> list[dict]:
        """The open item's closing events, and a new item's opening ones (kind "call": call is its first delta; None:
        none opens)."""
        events = []
        if self.open is not None:
            events = self.finish()
        if kind is not None:
            events += self.begin(kind, call)
        self.open = kind
        self.text = ""
        return events

    async def reply(self, http: Request, answer: Callable, chat: dict, names: dict, stream: bool) -> Response | dict:
        """The reply to a request translated into `chat`, a chat body: whole, or (stream) as events. answer: app's
        (build_app's); names: chat's names for the fields that the API names otherwise (an error names the API's)."""
        chat |= {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        try:
            events = self.events(await answer(http, chat, True))
            if stream:
                return StreamingResponse(event_stream(events, self.failed), media_type="text/event-stream")
            async for _ in events:
                pass
        except InvalidField as e:
            raise type(e)(names.get(e.field, e.field), e.problem) from None
        return self.whole
