"""Engine settings: one dataclass that checks every field's type and value before any work starts."""

import os
from dataclasses import dataclass, fields

import torch

from nanoserve.kernels import HAVE_TRITON
from nanoserve.sampling_params import InvalidField, check_number

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CHOICES = {"dtype": ("auto", *DTYPES), "device": ("auto", "cpu", "cuda"), "kernels": ("auto", "triton", "torch")}
LEAST = {
    "max_model_len": 2,
    "max_num_seqs": 1,
    "max_num_batched_tokens": 1,
    "kvcache_block_size": 16,
    "num_kvcache_blocks": 1,
    "tensor_parallel_size": 1,
    "threads": 1,
}  # integer fields (None allowed where it is the default), least values


@dataclass
class EngineConfig:
    model: str | None = None  # HF directory or hub id; None is the embedded default model
    max_model_len: int = 4096  # longest sequence, prompt plus output
    max_num_seqs: int = 256  # sequences in one step
    max_num_batched_tokens: int = 8192  # tokens in one step: the budget that chunked prefill splits by
    kvcache_block_size: int = 16  # tokens per KV block
    num_kvcache_blocks: int | None = None  # None: size the pool from memory
    gpu_memory_utilization: float = 0.9  # share of the GPU that weights, activations and KV may use
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # no CUDA graphs
    overlap: bool = True  # launch step n+1 before reading step n back; False: the plain loop
    trace: str | None = None  # a path: write one JSON line per step there (plots.py)
    tensor_parallel_size: int = 1  # processes (GPUs) the model is split across (parallel.py)
    threads: int | None = None  # CPU: torch threads; None: the cores other processes leave free
    dtype: str = "auto"  # auto: float32 on CPU; on GPU the checkpoint's if 16-bit, else bf16
    device: str = "auto"  # auto: cuda when available
    kernels: str = "auto"  # triton: our kernels; torch: their PyTorch references; auto: triton on cuda

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        if unknown := sorted(set(kwargs) - {f.name for f in fields(cls)}):
            raise InvalidField(unknown[0], f"unknown config keys: {', '.join(unknown)}")
        return cls(**kwargs)

    def __post_init__(self):
        for name in ("model", "trace"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise InvalidField(name, f"{getattr(self, name)!r} is not a path")
        for name, least in LEAST.items():
            if getattr(self, name) is not None or name not in ("num_kvcache_blocks", "threads"):
                check_number(name, getattr(self, name), low=least, integer=True)
        if self.kvcache_block_size > 256 or self.kvcache_block_size & (self.kvcache_block_size - 1):
            raise InvalidField("kvcache_block_size", f"{self.kvcache_block_size} is not a power of two in [16, 256]")
        check_number("gpu_memory_utilization", self.gpu_memory_utilization, low=0, high=1, above_low=True)
        for name in ("enable_prefix_caching", "enforce_eager", "overlap"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidField(name, f"{getattr(self, name)!r} is not a bool")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise InvalidField(name, f"{getattr(self, name)!r} is not one of {', '.join(allowed)}")
        if self.kernels == "triton" and not HAVE_TRITON:
            raise InvalidField("kernels", "'triton' needs the triton package (Linux only); use kernels='torch'")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise InvalidField("device", "'cuda' but no GPU is visible to torch")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and self.tensor_parallel_size > torch.cuda.device_count():
            raise InvalidField(
                "tensor_parallel_size",
                f"{self.tensor_parallel_size} exceeds the {torch.cuda.device_count()} GPUs present",
            )
        if self.kernels == "auto":
            self.kernels = "triton" if self.device == "cuda" and HAVE_TRITON else "torch"
        if (
            self.kernels == "triton"
            and self.device == "cpu"
            and os.environ.get("TRITON_INTERPRET", "").lower() not in ("1", "true", "on", "yes")
        ):
            raise InvalidField("kernels", "'triton' on a CPU needs TRITON_INTERPRET=1 set before nanoserve is imported")
        if self.device == "cpu" or self.kernels == "torch":
            self.enforce_eager = True  # CUDA graphs need a GPU and the sync-free Triton kernels

    def torch_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        half = checkpoint_dtype if checkpoint_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
        return torch.float32 if self.device == "cpu" else half
