"""An extension: tool calls parsed out of a model's text, for chat's tool_choice "auto": the OpenAI server's
--enable-auto-tool-choice --tool-call-parser NAME, as vLLM's server takes them (ext/server loads this when the flag is
given; without it, the server serves on, and only the flag is refused). One format so far, hermes (Hermes 2 Pro's, and
Qwen 2.5's and Qwen 3's chat templates): the model writes each call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and the server returns it as an OpenAI tool call ({"id", "type": "function", "function": {"name", "arguments"}}, the
arguments as a JSON string). The text outside the blocks is the message's content; whitespace right after a call is not
(the model separates calls with newlines). A block whose text is not such a call stays in the content as the model
wrote it, so nothing the model wrote is lost.

One idea: a parser is fed a choice's text piece by piece, a stream's deltas or the whole text at once, and hands out
content as soon as it cannot be the start of a block and each call as soon as its block closes, so a stream's pieces
join to exactly what the whole answer holds. A block the output never closes (max_tokens, or EOS right after the JSON)
is read at the end: a call if its JSON is one, else content."""

import json
import uuid

from nanoserve.checks import InvalidField, shown
from nanoserve.stopping import longest_stop_prefix_at_end

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser:
    """One choice's tool calls and content, as its text comes."""

    def __init__(self) -> None:
        self.pending = ""  # text not handed out yet: an open block, or a tail that may be the start of one
        self.in_block = False  # pending is inside a <tool_call> block
        self.after_call = False  # a call has just closed: whitespace here is a separator, not content
        self.num_calls = 0  # calls handed out so far: the next one's index in a stream

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """The content and the calls that `text`, the output's next piece, completes. final: the output has ended, so
        nothing is held back."""
        self.pending += text
        content = ""
        calls = []
        while True:
            if not self.in_block:
                start = self.pending.find(START)
                if start < 0:  # no block starts: all content, less a tail that may still become "<tool_call>"
                    held = 0 if final else longest_stop_prefix_at_end(self.pending, [START])
                    content += self._content(self.pending[: len(self.pending) - held])
                    self.pending = self.pending[len(self.pending) - held :]
                    return content, calls
                content += self._content(self.pending[:start])
                self.pending = self.pending[start + len(START) :]
                self.in_block = True
            end = self.pending.find(END)
            if end < 0 and not final:  # the block is still open: wait for the rest of it
                return content, calls
            block = self.pending if end < 0 else self.pending[:end]
            self.pending = "" if end < 0 else self.pending[end + len(END) :]
            self.in_block = False
            call = self._call(block)
            if call is None:  # not a call: the block is content, as the model wrote it
                content += self._content(START + block + ("" if end < 0 else END))
            else:
                calls.append(call)
                self.after_call = True

    def _content(self, text: str) -> str:
        """text as content: right after a call, without its leading whitespace."""
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        return text

    def _call(self, block: str) -> dict | None:
        """A block's text as an OpenAI tool call (with its index, for a stream's deltas), or None where it is not a
        JSON object with a string "name" (and "arguments", any JSON value, by default {})."""
        try:
            call = json.loads(block)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = json.dumps(call.get("arguments", {}), ensure_ascii=False)
        self.num_calls += 1
        function = {"name": call["name"], "arguments": arguments}
        return {"index": self.num_calls - 1, "id": f"call_{uuid.uuid4().hex}", "type": "function", "function": function}


TOOL_PARSERS = {"hermes": HermesToolParser}  # --tool-call-parser's choices: a name -> its parser, one per choice


def parser_for(name: str) -> type[HermesToolParser]:
    """The parser --tool-call-parser names; any other name is an InvalidField."""
    if name not in TOOL_PARSERS:
        raise InvalidField("tool_call_parser", f"{shown(name)} is not one of {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]
