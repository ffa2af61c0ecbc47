"""vLLM's tokenizer endpoints, with vLLM's request and response fields: POST /tokenize (a prompt, or chat messages
through the chat template, to token ids: tokens, count, max_model_len, and with return_token_strs each token's string),
POST /detokenize (tokens to the text, as prompt), and GET /tokenizer_info (the special tokens and the chat template:
what lm-evaluation-harness's remote tokenizer reads). Behind the API key like every API route; a prompt's characters
are capped as the completions' are, and tokenizing runs on the executor, off the event loop and the engine thread."""

import asyncio
from collections.abc import Callable
from functools import partial

from fastapi import APIRouter, Request

from nanoserve.checks import InvalidField, check_text, check_token_ids
from nanoserve.ext.chat import chat_prompts
from nanoserve.ext.server.shared import ServerConfig, check_known, field, normalized, read_object, string
from nanoserve.llm import LLM

# The bodies' fields (check_known, as in app.py): vLLM's, less those for other models (multimodal) and templates
TOKENIZE = "model prompt messages tools add_special_tokens return_token_strs".split()
TOKENIZE_NEUTRAL = {"add_generation_prompt": True, "continue_final_message": False}  # what chat_prompts does
DETOKENIZE = "model tokens".split()


def add_routes(router: APIRouter, llm: LLM, config: ServerConfig, check_model: Callable, check_chars: Callable) -> None:
    """The three routes on router, for llm's tokenizer (a model without one, weights only, has none of them);
    check_model and check_chars: build_app's."""
    tokenizer = llm.tokenizer
    if tokenizer is None:
        return

    @router.post("/tokenize", response_model=None)
    async def tokenize(http: Request) -> dict:
        body = await read_object(http, config)
        check_known(body, TOKENIZE, [], TOKENIZE_NEUTRAL)
        check_model(body)
        chat = "messages" in body
        # vLLM's defaults: a prompt gets the special tokens (BOS); a conversation, those its template writes
        special = field(body, "add_special_tokens", bool, not chat)
        if chat and special:
            raise InvalidField("add_special_tokens", "nanoserve does not implement it with messages yet")
        if chat:
            check_chars(body["messages"], "messages")
            (ids,) = await asyncio.to_thread(chat_prompts, llm, [normalized(body["messages"])], body.get("tools"))
        else:
            prompt = string(body, "prompt")
            check_chars(prompt, "prompt")
            check_text("prompt", prompt)
            ids = await asyncio.to_thread(partial(tokenizer.encode, prompt, add_special_tokens=special))
        result = {"count": len(ids), "max_model_len": llm.config.max_model_len, "tokens": ids, "token_strs": None}
        if field(body, "return_token_strs", bool, False):
            result["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
        return result

    @router.post("/detokenize", response_model=None)
    async def detokenize(http: Request) -> dict:
        body = await read_object(http, config)
        check_known(body, DETOKENIZE, [], {})
        check_model(body)
        ids = check_token_ids("tokens", body.get("tokens"), llm.vocab_size)
        return {"prompt": await asyncio.to_thread(tokenizer.decode, ids)}

    @router.get("/tokenizer_info", response_model=None)
    def tokenizer_info() -> dict:
        info = {"tokenizer_class": type(tokenizer).__name__, "chat_template": tokenizer.chat_template}
        return {**info, **tokenizer.special_tokens_map, "model_max_length": llm.config.max_model_len}
