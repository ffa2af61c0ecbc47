"""An extension, and an application of the engine: the OpenAI-compatible HTTP server, vLLM's `vllm serve`.

  app.py       the server: the endpoints, the engine's thread, the checks of every request field
  cli.py       the `nanoserve serve [MODEL]` command
  __main__.py  `python -m nanoserve.ext.server`, the same server with every option as a flag

Nothing in the core calls it: it drives the engine through its public API (LLM.add_request, step, abort, stats)."""
