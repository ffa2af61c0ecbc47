"""nanoserve: a small, readable LLM inference engine with paged KV cache, prefix caching, continuous batching with
chunked prefill, preemption by recompute, CUDA-graph decode and Triton paged attention.

The engine's bookkeeping (sequence, block_manager, scheduler, stopping) is plain Python: importing it loads no
torch. LLM is imported on first use, so `import nanoserve.scheduler` stays light. The library adds no logging
handler; example.py and bench.py show its start-up lines (the KV cache account) by configuring logging."""
from nanoserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]

def __getattr__(name: str):
    if name == "LLM":
        from nanoserve.llm import LLM
        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from nanoserve import outputs
        return getattr(outputs, name)
    raise AttributeError(f"module 'nanoserve' has no attribute {name!r}")
