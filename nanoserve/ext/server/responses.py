"""OpenAI's Responses API, as OpenAI specifies it and vLLM serves it: POST /v1/responses and GET /v1/responses/{id},
what the OpenAI Agents SDK and Codex speak. A request is translated into a chat body (chat_body) and answered by the
chat pipeline (app.py's answer: the same checks, caps, sampling, tool parser and cancellation), whose stream of chunks
becomes the Responses events (ResponseEvents); a whole response is the one the last event carries.

The input is a string or a list of items: messages (text parts only: input_text, output_text), and the function_call
and function_call_output items of a tool-call turn (each output must follow its call). instructions are the system
message. tools are functions (strict or not: the schema is enforced where the call is forced, by a named tool_choice
or "required", through the structured-outputs extension; with "auto" the tool parser returns what the model wrote);
text.format is text, json_object or json_schema. A response with store (OpenAI's default) is kept in memory, at most
ServerConfig.max_stored_responses of them, the least recently used dropped first: previous_response_id continues its
conversation (its input and output items, not its instructions, as OpenAI's), and GET returns it; an id not kept is a
404 naming it. Fields nanoserve does not implement (reasoning that asks for something, background, include, built-in
tools such as web_search, conversation, ...) are refused by name."""

import copy
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from nanoserve.checks import InvalidField, shown
from nanoserve.ext.server.app import NotFound, ServerConfig, Translated, chat_messages, check_known, field, read_object

# The body's fields (check_known), as in app.py: honoured; accepted and ignored (they change nothing the client gets);
# not implemented, refused unless their value asks for nothing
HONOURED = """
    model input instructions tools tool_choice max_output_tokens temperature top_p text parallel_tool_calls store
    previous_response_id stream
""".split()
IGNORED = (
    "user metadata service_tier safety_identifier prompt_cache_key prompt_cache_retention prompt_cache_options".split()
)
NOT_IMPLEMENTED = dict.fromkeys(
    """
    conversation prompt max_tool_calls background_options context_management stream_options access_programs image
    moderation
    """.split()
) | {"background": False, "reasoning": {}, "include": [], "truncation": "disabled", "top_logprobs": 0}
# What a response repeats of its request, with OpenAI's defaults
ECHOED = {
    "instructions": None,
    "max_output_tokens": None,
    "metadata": {},
    "parallel_tool_calls": True,
    "previous_response_id": None,
    "store": True,
    "temperature": 1.0,
    "text": {"format": {"type": "text"}},
    "tool_choice": "auto",
    "tools": [],
    "top_p": 1.0,
}
# chat's names for the fields that the Responses API names otherwise
CHAT_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


class ResponseStore:
    """The responses kept (store: true), each with its conversation's items, at most `size`: the least recently used
    (made or read) is dropped first."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.kept: OrderedDict[str, tuple[dict, list]] = OrderedDict()  # id -> (response, input and output items)

    def get(self, response_id: str, name: str) -> tuple[dict, list]:
        """The response and its conversation; an id not kept is a NotFound naming the field `name`."""
        if response_id not in self.kept:
            raise NotFound(name, f"no response {shown(response_id)} is stored here (a server keeps its last few)")
        self.kept.move_to_end(response_id)
        return self.kept[response_id]

    def put(self, response: dict, items: list) -> None:
        self.kept[response["id"]] = (response, items)
        if len(self.kept) > self.size:
            self.kept.popitem(last=False)


def chat_tools(tools: list) -> list[dict]:
    """Function tools in chat's shape; any other (OpenAI's built-in tools) is refused by name."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise InvalidField(f"tools[{i}].type", f"nanoserve does not implement {shown(kind)} tools, only function")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        out.append({"type": "function", "function": function})
    return out


def input_items(body: dict) -> list:
    """The body's input as a list of items (a string is one user message)."""
    items = body.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    if not isinstance(items, list):
        raise InvalidField("input", "expected a string or a list of items")
    return items


def chat_body(body: dict, history: list, items: list) -> dict:
    """The chat body that answers a Responses body whose input is items; history: the conversation of its
    previous_response_id."""
    names = ["previous_response_id"] * len(history) + [f"input[{i}]" for i in range(len(items))]
    messages = chat_messages([*history, *items], names)
    instructions = field(body, "instructions", str, "")
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":  # {"type": "function", "name": ...}
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    text = field(body, "text", dict, {})
    check_known(text, ["format"], [], {"verbosity": "medium"}, "text.")
    response_format = field(text, "format", dict, {"type": "text"})
    if response_format.get("type") == "json_schema":  # chat's nests the name, schema and strict one level deeper
        response_format = {"type": "json_schema", "json_schema": response_format}
    return {
        "model": body.get("model"),
        "messages": messages,
        "tools": chat_tools(field(body, "tools", list, [])),
        "tool_choice": choice,
        "max_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "response_format": response_format,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


class ResponseEvents(Translated):
    """A response as the Responses API streams it: response.created and .in_progress; per output item (a message with
    one output_text part, or a function_call) .output_item.added (and .content_part.added), its deltas
    (.output_text.delta, .function_call_arguments.delta), its .done events and .output_item.done; last,
    response.completed (or .incomplete, cut at max_output_tokens) with the whole response and its usage. Every event
    has its sequence_number, and a copy of what it shows as it was then. A response that ends is put in `store` (None:
    not kept) with its conversation: `items` (the input's, after those of its previous response) and its output."""

    def __init__(self, response: dict, store: ResponseStore | None, items: list) -> None:
        self.whole = response
        self.store = store
        self.items = items
        self.sequence_number = 0

    def event(self, kind: str, **fields: object) -> dict:
        event = {"type": f"response.{kind}", "sequence_number": self.sequence_number, **copy.deepcopy(fields)}
        self.sequence_number += 1
        return event

    def where(self) -> dict:
        """The open item's place, as its events give it."""
        return {"item_id": self.whole["output"][-1]["id"], "output_index": len(self.whole["output"]) - 1}

    def start(self, chunk: dict) -> list[dict]:
        self.whole["model"] = chunk["model"]
        return [self.event("created", response=self.whole), self.event("in_progress", response=self.whole)]

    def begin(self, kind: str, call: dict) -> list[dict]:
        item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress", "role": "assistant"}
        item["content"] = []
        if kind == "call":
            item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress"}
            item |= {"call_id": call["id"], "name": call["function"]["name"], "arguments": ""}
        self.whole["output"].append(item)
        events = [self.event("output_item.added", output_index=self.where()["output_index"], item=item)]
        if kind == "text":
            item["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            events.append(self.event("content_part.added", **self.where(), content_index=0, part=item["content"][0]))
        return events

    def add(self, piece: str) -> list[dict]:
        item = self.whole["output"][-1]
        if self.open == "text":
            item["content"][0]["text"] += piece
            return [self.event("output_text.delta", **self.where(), content_index=0, delta=piece, logprobs=[])]
        item["arguments"] += piece
        return [self.event("function_call_arguments.delta", **self.where(), delta=piece)]

    def finish(self) -> list[dict]:
        item = self.whole["output"][-1]
        item["status"] = "completed"
        if self.open == "text":
            part = item["content"][0]
            events = [
                self.event("output_text.done", **self.where(), content_index=0, text=part["text"], logprobs=[]),
                self.event("content_part.done", **self.where(), content_index=0, part=part),
            ]
        else:
            arguments = item["arguments"]
            events = [
                self.event("function_call_arguments.done", **self.where(), name=item["name"], arguments=arguments)
            ]
        return [*events, self.event("output_item.done", output_index=self.where()["output_index"], item=item)]

    def end(self, finish_reason: str, usage: dict) -> list[dict]:
        self.whole["status"] = "completed"
        if finish_reason == "length":
            self.whole["status"] = "incomplete"
            self.whole["incomplete_details"] = {"reason": "max_output_tokens"}
        self.whole["usage"] = {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": usage["prompt_tokens_details"],
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        }
        if self.store is not None:
            self.store.put(self.whole, [*self.items, *self.whole["output"]])
        return [self.event(self.whole["status"], response=self.whole)]

    def failed(self, message: str) -> dict:
        self.whole["status"] = "failed"
        self.whole["error"] = {"code": "server_error", "message": message}
        return self.event("failed", response=self.whole)


def add_routes(router: APIRouter, answer: Callable, config: ServerConfig) -> None:
    """POST /v1/responses and GET /v1/responses/{response_id} on router, answered by answer (app.py's)."""
    store = ResponseStore(config.max_stored_responses)

    @router.post("/v1/responses", response_model=None)
    async def create(http: Request) -> StreamingResponse | dict:
        """A response, whole or (stream) as its events; stored, if asked, once it has ended."""
        body = await read_object(http, config)
        check_known(body, HONOURED, IGNORED, NOT_IMPLEMENTED)
        stream = field(body, "stream", bool, False)
        parallel = field(body, "parallel_tool_calls", bool, True)
        kept = None
        if field(body, "store", bool, True):
            kept = store
        history = []
        previous = field(body, "previous_response_id", str, None)
        if previous is not None:
            history = store.get(previous, "previous_response_id")[1]
        items = input_items(body)
        chat = chat_body(body, history, items)
        response = {
            "id": f"resp_{uuid.uuid4().hex}",
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "model": None,  # the one that answers, from the first chunk
            "output": [],
            "error": None,
            "incomplete_details": None,
            "usage": None,
        } | {name: body.get(name, default) for name, default in ECHOED.items()}
        translated = ResponseEvents(response, kept, [*history, *items])
        return await translated.reply(http, answer, chat, CHAT_NAMES, parallel, stream)

    @router.get("/v1/responses/{response_id}", response_model=None)
    def retrieve(response_id: str) -> dict:
        return store.get(response_id, "response_id")[0]
