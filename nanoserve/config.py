"""Engine settings: one dataclass that checks every field before any work starts."""
from dataclasses import dataclass, fields

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class EngineConfig:
    model: str | None = None            # HF directory or hub id; None is the embedded default model
    max_model_len: int = 4096           # longest sequence, prompt plus output
    max_num_seqs: int = 256             # sequences in one step
    max_num_batched_tokens: int = 8192  # tokens in one step: the budget that chunked prefill splits by
    kvcache_block_size: int = 16        # tokens per KV block
    num_kvcache_blocks: int | None = None    # None: size the pool from memory
    gpu_memory_utilization: float = 0.9      # share of the GPU that weights, activations and KV may use
    enable_prefix_caching: bool = True
    enforce_eager: bool = False         # no CUDA graphs
    dtype: str = "auto"                 # auto: float32 on CPU; on GPU the checkpoint's if 16-bit, else bf16
    device: str = "auto"                # auto: cuda when available
    kernels: str = "auto"               # "triton": our attention and fused-layer kernels; "torch": the PyTorch
                                        # reference they are tested against; auto: triton on cuda

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown config keys: {', '.join(unknown)}")
        return cls(**kwargs)

    def __post_init__(self):
        bs = self.kvcache_block_size
        checks = {
            "max_model_len": self.max_model_len >= 2,
            "max_num_seqs": self.max_num_seqs >= 1,
            "max_num_batched_tokens": self.max_num_batched_tokens >= 1,
            "kvcache_block_size": 16 <= bs <= 256 and bs & (bs - 1) == 0,  # kernels tile by powers of 2
            "num_kvcache_blocks": self.num_kvcache_blocks is None or self.num_kvcache_blocks >= 1,
            "gpu_memory_utilization": 0 < self.gpu_memory_utilization <= 1,
            "dtype": self.dtype == "auto" or self.dtype in DTYPES,
            "device": self.device in ("auto", "cpu", "cuda"),
            "kernels": self.kernels in ("auto", "triton", "torch"),
        }
        for field, ok in checks.items():
            if not ok:
                raise ValueError(f"{field}={getattr(self, field)!r} is not allowed")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.kernels == "auto":
            self.kernels = "triton" if self.device == "cuda" else "torch"
        if self.device == "cpu" or self.kernels == "torch":
            self.enforce_eager = True  # CUDA graphs need a GPU and the sync-free Triton kernels

    def torch_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if self.device == "cpu":
            return torch.float32
        return checkpoint_dtype if checkpoint_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
