"""nanoserve: a small, readable LLM inference engine with paged KV cache, prefix caching, continuous
batching with chunked prefill, preemption by recompute, CUDA-graph decode and Triton paged attention."""
import logging

from nanoserve.llm import LLM, RequestOutput
from nanoserve.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]

_logger = logging.getLogger("nanoserve")
if not _logger.handlers:  # start-up facts (KV cache size) are shown, as vLLM shows them
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("nanoserve: %(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(logging.INFO)
    _logger.propagate = False  # an application's own logging config would print each line twice
