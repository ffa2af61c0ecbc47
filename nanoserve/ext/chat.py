"""Chat: a conversation becomes a prompt through the model's chat template. A chat model was fine-tuned on text laid out
one particular way (role markers, special tokens between turns, a cue that the assistant speaks next), and the template,
a Jinja program shipped with the tokenizer, writes a list of {"role", "content"} messages out in that layout. So chat
is nothing more than a way to make a prompt: the engine then generates from its token ids like any other.

LLM.chat (vLLM's name) calls chat_prompts here; so do the server's /v1/chat/completions and example.py. What this file
adds to the template is the checking: a malformed message would otherwise fail deep inside Jinja (an UndefinedError)
or render as nothing at all, so each message is checked first and a bad one named as the field "messages"."""

from typing import TYPE_CHECKING

from nanoserve.checks import LISTS, InvalidField, check_text, shown

if TYPE_CHECKING:
    from nanoserve.llm import LLM

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")  # the roles chat templates know


def chat_prompts(llm: "LLM", messages: object, tools: list[dict] | None = None) -> list[list[int]]:
    """Each conversation through the chat template, as token ids (the template adds the special tokens). messages: one
    conversation (a list of message dicts) or a list of them; tools: OpenAI's function definitions, which a template
    that supports tools renders."""
    tokenizer = llm.tokenizer
    if tokenizer is None or not tokenizer.chat_template:
        raise InvalidField("model", "this model has no chat template")
    # a list of conversations, or one (anything else is one too, which check_conversation then refuses)
    is_many = isinstance(messages, LISTS) and messages and isinstance(messages[0], LISTS)
    conversations = messages if is_many else [messages]
    for conversation in conversations:
        check_conversation(conversation)
    # all at once, as token ids (return_dict=False: a list of id lists, not a BatchEncoding)
    return tokenizer.apply_chat_template(conversations, add_generation_prompt=True, return_dict=False, tools=tools)


def check_conversation(conversation: object) -> None:
    """A non-empty list of {"role": one of CHAT_ROLES, "content": valid Unicode text} dicts; an optional "name" is a
    string too."""
    if not isinstance(conversation, LISTS) or not conversation:
        raise InvalidField("messages", "expected a non-empty list of {'role': str, 'content': str} dicts")
    for message in conversation:
        is_valid = (
            isinstance(message, dict)
            and message.get("role") in CHAT_ROLES
            and isinstance(message.get("content"), str)
            and isinstance(message.get("name", ""), str)
        )
        if not is_valid:
            wanted = f"{{'role': one of {', '.join(CHAT_ROLES)}; 'content': str; optional 'name': str}}"
            raise InvalidField("messages", f"{shown(message)} is not {wanted}")
        check_text("messages", message["content"])
