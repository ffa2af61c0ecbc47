"""nanoserve: a small, readable LLM inference engine with paged KV cache, prefix caching, continuous batching with
chunked prefill, preemption by recompute, CUDA-graph decode and Triton paged attention.

The engine's bookkeeping (sequence, block_manager, scheduler, stopping) is plain Python: importing it loads no
torch. LLM is imported on first use, so `import nanoserve.scheduler` stays light. The library adds no logging
handler; example.py and bench.py show its start-up lines (the KV cache account) by configuring logging."""

import importlib

from nanoserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
LAZY = {"LLM": "nanoserve.llm", "RequestOutput": "nanoserve.outputs", "CompletionOutput": "nanoserve.outputs"}


def __getattr__(name: str) -> object:
    if name in LAZY:
        return getattr(importlib.import_module(LAZY[name]), name)
    raise AttributeError(f"module 'nanoserve' has no attribute {name!r}")
