"""An extension of the server (ext/server), which mounts it where it is installed: Anthropic's Messages API, as vLLM
serves it: POST /v1/messages, what Anthropic-style agent tools speak. A request is
translated into a chat body (chat_body) and answered by the chat pipeline (app.py's answer: the same checks, caps,
sampling, tool parser and cancellation), whose stream of chunks becomes Anthropic's events (MessageEvents); a whole
message is what those events build. Errors come in Anthropic's shape ({"type": "error", "error": {"type",
"message"}}; invalid_request_error for bad input, api_error for the engine's fault), the field at fault named at the
start of the message; a request that fails once its stream has begun ends with Anthropic's error event. The API key
may come as Anthropic's x-api-key.

Honoured: system (a text, or text blocks), messages with text, tool_use and tool_result blocks (each result after its
call), tools (custom ones: name, description, input_schema) and tool_choice (auto, any: chat's "required", none, tool;
disable_parallel_tool_use is accepted as chat's parallel_tool_calls is), max_tokens (required, as Anthropic's),
stop_sequences, temperature, top_p, top_k, stream. Anthropic's stop reasons from chat's finish reasons, as vLLM maps
them: end_turn (EOS, or a stop sequence: the engine does not say which ended it, so stop_sequence is null),
max_tokens, tool_use. A tool_use block's
input is the JSON object the model wrote; {} where it wrote none, or was cut (stop_reason max_tokens) before the object
closed. Server tools, images, documents, thinking and the other fields nanoserve does not implement are refused by
name."""

import copy
import json
import uuid
from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response

from nanoserve.checks import InvalidField, shown
from nanoserve.ext.server.shared import (
    ServerConfig,
    Translated,
    chat_messages,
    check_known,
    field,
    function_tools,
    message_text,
    read_object,
    status_of,
    string,
)

PATH = "/v1/messages"
# The body's fields (check_known), as in app.py
HONOURED = "model messages system max_tokens stop_sequences temperature top_p top_k tools tool_choice stream".split()
IGNORED = ["metadata", "service_tier"]  # metadata.user_id; the tier is a hint
NOT_IMPLEMENTED = dict.fromkeys(
    "container mcp_servers context_management output_config cache_control inference_geo speed diagnostics".split()
) | {"thinking": {"type": "disabled"}}
# The fields a chat body takes as they are: chat's name -> Anthropic's (errors name Anthropic's)
PASSED = {"model": "model", "max_tokens": "max_tokens", "stop": "stop_sequences"}
PASSED |= {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # Anthropic's tool_choice type -> chat's
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}  # chat's finish reason -> these
# an error's HTTP status -> Anthropic's error type; others: invalid_request_error below 500 (400, 405, 408), else
# api_error
ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large"}


def error_body(status: int, message: str) -> dict:
    """Anthropic's error body."""
    kind = ERROR_TYPES.get(status, "invalid_request_error")
    if status >= 500:
        kind = "api_error"
    return {"type": "error", "error": {"type": kind, "message": message}}


def input_items(messages: object) -> tuple[list, list[str]]:
    """Anthropic's messages as the Responses API's items (shared.py's chat_messages reads them), with each item's name
    for errors: a message whose content is a text is a message item; of a list of blocks, the text blocks are one
    message item (where the first of them is), a tool_use block a function_call, a tool_result a
    function_call_output."""
    if not isinstance(messages, list):
        raise InvalidField("messages", "expected a list of messages")
    items = []
    names = []
    call_ids = set()  # of the tool_use blocks so far
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidField(f"messages[{i}]", "expected a message (an object)")
        item = {"type": "message", "role": message.get("role"), "content": message.get("content")}
        if not isinstance(item["content"], list):  # a text (anything else is chat's to refuse)
            items.append(item)
            names.append(f"messages[{i}]")
            continue
        text = None  # the message item of its text blocks, once it has one
        for j, block in enumerate(item["content"]):
            name = f"messages[{i}].content[{j}]"
            kind = None
            if isinstance(block, dict):
                kind = block.get("type")
            if kind == "text" and text is None:
                text = {**item, "content": []}
                items.append(text)
                names.append(name)
            if kind == "text":
                string(block, "text", f"{name}.")
                text["content"].append(block)
                continue
            if kind == "tool_use":
                call_ids.add(string(block, "id", f"{name}."))
                arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
                items.append({"type": "function_call", "call_id": block["id"], "name": block.get("name")})
                items[-1]["arguments"] = arguments
            elif kind == "tool_result":
                if string(block, "tool_use_id", f"{name}.") not in call_ids:
                    raise InvalidField(f"{name}.tool_use_id", "names no tool_use block before it")
                output = block.get("content", "")
                items.append({"type": "function_call_output", "call_id": block["tool_use_id"], "output": output})
            else:
                raise InvalidField(f"{name}.type", f"nanoserve does not implement {shown(kind)} blocks yet")
            names.append(name)
    return items, names


def chat_body(body: dict) -> dict:
    """The chat body that answers a Messages body."""
    if body.get("max_tokens") is None:
        raise InvalidField("max_tokens", "is required")
    system = body.get("system")
    if isinstance(system, list):
        system = message_text(system, "system")
    if not isinstance(system, str | None):
        raise InvalidField("system", "expected a text or a list of text blocks")
    messages = chat_messages(*input_items(body.get("messages")))
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    tool_choice = field(body, "tool_choice", dict, {})
    kind = tool_choice.get("type")
    if tool_choice and kind not in (*TOOL_CHOICES, "tool"):
        raise InvalidField("tool_choice.type", f"{shown(kind)} is not auto, any, none or tool")
    choice = TOOL_CHOICES.get(kind)  # None: none given, chat's default (app.py's tool_choice)
    if kind == "tool":
        choice = {"type": "function", "function": {"name": tool_choice.get("name")}}
    tools = function_tools(body.get("tools") or [], "custom", "input_schema")
    chat = {name: body.get(ours) for name, ours in PASSED.items()}
    return chat | {"messages": messages, "tools": tools, "tool_choice": choice}


def tool_input(arguments: str) -> dict:
    """A call's arguments as its tool_use block's input: the JSON object the model wrote, else {}."""
    try:
        value = json.loads(arguments)
    except ValueError:  # none written, or cut before the object closed
        return {}
    if not isinstance(value, dict):
        return {}
    return value


class MessageEvents(Translated):
    """A message as Anthropic streams it: message_start; per content block (a text, or a tool_use)
    content_block_start, its content_block_delta events (text_delta, input_json_delta) and content_block_stop; last,
    message_delta with the stop reason and the usage, and message_stop. A request that fails ends with an error
    event, in Anthropic's error shape."""

    def __init__(self) -> None:
        self.whole = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "content": []}
        self.whole |= {"stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}

    def event(self, kind: str, **fields: object) -> dict:
        """An event about the newest content block, which it names by its index."""
        return {"type": kind, "index": len(self.whole["content"]) - 1, **fields}

    def start(self, chunk: dict) -> list[dict]:
        self.whole["model"] = chunk["model"]
        self.whole["usage"]["input_tokens"] = chunk["usage"]["prompt_tokens"]
        return [{"type": "message_start", "message": copy.deepcopy(self.whole)}]

    def begin(self, kind: str, call: dict) -> list[dict]:
        block = {"type": "text", "text": ""}
        if kind == "call":
            block = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}}
        self.whole["content"].append(block)
        return [self.event("content_block_start", content_block=dict(block))]

    def delta(self, piece: str) -> list[dict]:
        delta = {"type": "input_json_delta", "partial_json": piece}
        if self.open == "text":
            delta = {"type": "text_delta", "text": piece}
        return [self.event("content_block_delta", delta=delta)]

    def finish(self) -> list[dict]:
        block = self.whole["content"][-1]
        if self.open == "text":
            block["text"] = self.text
        else:
            block["input"] = tool_input(self.text)
        return [self.event("content_block_stop")]

    def end(self, finish_reason: str, usage: dict) -> list[dict]:
        self.whole["stop_reason"] = STOP_REASONS[finish_reason]
        self.whole["usage"] = {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}
        delta = {"stop_reason": self.whole["stop_reason"], "stop_sequence": None}
        return [{"type": "message_delta", "delta": delta, "usage": dict(self.whole["usage"])}, {"type": "message_stop"}]

    def failed(self, error: Exception) -> list[dict]:
        return [error_body(status_of(error), str(error))]


def add_routes(router: APIRouter, answer: Callable, config: ServerConfig, model_name: str) -> None:
    """POST /v1/messages on router, answered by answer (the server's chat pipeline, ext/server/app.py)."""

    @router.post(PATH, response_model=None)
    async def create(http: Request) -> Response | dict:
        body = await read_object(http, config)
        check_known(body, HONOURED, IGNORED, NOT_IMPLEMENTED)
        stream = field(body, "stream", bool, False)
        return await MessageEvents().reply(http, answer, chat_body(body), PASSED, stream)
