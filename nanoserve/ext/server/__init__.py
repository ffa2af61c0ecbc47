"""An extension, and an application of the engine: the OpenAI-compatible HTTP server, vLLM's `vllm serve`.

  app.py       the server: the OpenAI endpoints, the engine's thread, the checks of every request field, and the
               chat pipeline every API answers through
  shared.py    what the APIs share: ServerConfig, reading and checking bodies, items as chat messages, the event loop
  tokens.py    vLLM's tokenizer endpoints (/tokenize, /detokenize, /tokenizer_info)
  cli.py       the `nanoserve serve [MODEL]` command
  __main__.py  `python -m nanoserve.ext.server`, the same server with every option as a flag

OpenAI's Responses API (/v1/responses) and Anthropic's Messages API (/v1/messages) are extensions of their own
(ext/responses_api.py, ext/messages_api.py), which app.py mounts where they are installed.

Nothing in the core calls it: it drives the engine through its public API (LLM.add_request, step, abort, stats)."""
