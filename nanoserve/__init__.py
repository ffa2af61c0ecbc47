"""nanoserve: a small, readable LLM inference engine with paged KV cache, prefix caching, continuous
batching with chunked prefill, preemption by recompute, CUDA-graph decode and Triton paged attention."""
from nanoserve.llm import LLM, RequestOutput
from nanoserve.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
