"""Engine settings: one dataclass that checks every field's type and value before any work starts, and resolves the
'auto' device and kernels for this machine (the 'auto' dtype waits for the checkpoint: torch_dtype). The fields that
belong to an extension (tensor_parallel_size: ext/tp; trace: ext/plots.py; lora_config: ext/lora.py) are checked by
it, and refused by name where it is not installed, unless left at the value that asks for nothing (ext/__init__.py's
tables)."""

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nanoserve.checks import InvalidField, Settings, check_numbers, shown
from nanoserve.ext import ENGINE_OPTIONS, extensions_asked, find, load
from nanoserve.sampling_params import SamplingParams
from nanoserve.triton_shim import HAVE_TRITON

if TYPE_CHECKING:  # for annotations only
    from transformers import PretrainedConfig

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CHOICES = {
    "dtype": ("auto", *DTYPES),
    "device": ("auto", "cpu", "cuda"),
    "kernels": ("auto", "triton", "torch"),
    "kv_cache_dtype": ("auto", "fp8"),
    "kvcache_block_size": (16, 32, 64, 128, 256),  # powers of two; a plain int by then (LIMITS)
}
# the default step budget (max_num_batched_tokens) per device: on a GPU vLLM's with chunked prefill; on a CPU a step of
# ~0.5-1 s with SmolLM2-135M on 2 cores (BENCHMARKS.md, 2026-11-24: TTFT, ITL)
STEP_TOKENS = {"cuda": 8192, "cpu": 512}
# check_numbers' limits for the number fields: integers up to MAX_INT where no high is given (threads' high, the
# machine's cores, is added in __post_init__); None, the default of some, is chosen at startup
LIMITS = {
    "max_model_len": {"low": 2},
    # at most 256 times vLLM's default (256), far above any GPU's batch, so that a huge value (10**9) is refused by name
    # before anything sized by it (the penalties' rows, the warm-up's batch) is allocated
    "max_num_seqs": {"low": 1, "high": 65_536},
    "max_num_batched_tokens": {"low": 1},
    "kvcache_block_size": {"low": 16},  # an integer here; then one of its CHOICES
    "num_kvcache_blocks": {"low": 1},
    "gpu_memory_utilization": {"low": 0, "high": 1, "above_low": True},
}
TRITON_INTERPRET_ON = ("1", "true", "on", "yes")  # values of TRITON_INTERPRET that turn Triton's interpreter on


@dataclass
class EngineConfig(Settings):
    model: str | None = None  # HF directory (a str or os.PathLike) or hub id; None is the embedded default model
    max_model_len: int = 4096  # longest sequence, prompt plus output
    max_num_seqs: int = 256  # sequences in one step
    # tokens in one step, the budget that chunked prefill splits by; None: the device's STEP_TOKENS (less on a CPU,
    # where a step of 8,192 prompt tokens takes tens of seconds and no stream advances meanwhile)
    max_num_batched_tokens: int | None = None
    kvcache_block_size: int = 16  # tokens per KV block
    num_kvcache_blocks: int | None = None  # None: size the pool from memory
    gpu_memory_utilization: float = 0.9  # share of the GPU that weights, activations and KV may use
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # no CUDA graphs
    # launch step n+1 before reading step n back; False: the plain loop. None: on with a GPU, off on a CPU, where host
    # and "device" are the same cores (nothing to overlap) and a new request's first token would wait one more step
    overlap: bool | None = None
    trace: str | None = None  # a path we may write (str or os.PathLike): one JSON line per step (ext/plots.py)
    tensor_parallel_size: int = 1  # processes (GPUs) the model is split across (ext/tp)
    threads: int | None = None  # CPU: torch threads, at most os.cpu_count(); None: the cores others leave free
    dtype: str = "auto"  # auto: float32 on CPU; on GPU the checkpoint's if 16-bit, else bf16
    device: str = "auto"  # auto: cuda when available
    kernels: str = "auto"  # triton: our kernels; torch: their PyTorch references; auto: triton on cuda
    seed: int | None = None  # the seed of requests that set none (vLLM's LLM(seed=)); any int, kept mod 2**63
    tokenizer: str | None = None  # a tokenizer folder (str or os.PathLike) other than the model's
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; fp8: float8 e4m3, 1 byte per element (attention.py)
    speculative_config: dict | str | None = None  # vLLM's keys, or their JSON (ext/speculative.py)
    # LoRA adapters (ext/lora.py): a LoRAConfig there, or a dict (or JSON text) of its fields, max_loras and the rest;
    # vLLM's enable_lora=True, max_loras=... make one (ext/vllm_names.py)
    lora_config: object = None
    # a decode step's shared leading blocks (a common system prompt) read once for all its sequences (ext/cascade.py)
    cascade_attention: bool = False
    # batch 1's launch-latency kernels (ext/latency): the weights of a step of few rows read by a split-K GEMV, the
    # decode's reduce merged into its last split, programmatic dependent launches. Off until a GPU run measures them
    latency_kernels: bool = False
    # quantized weights by vLLM's method names ("awq", "gptq", "compressed-tensors", "fp8"); None: the checkpoint's
    # own format if it has one, else 16-bit (ext/quantization)
    quantization: str | None = None
    # a host-memory tier behind the prefix cache, in GiB, and its backend, vLLM's names (ext/kv_offload)
    kv_offloading_size: float | None = None
    kv_offloading_backend: str | None = None
    # prefill and decode on separate engines (ext/kv_transfer): vLLM's KVTransferConfig keys (kv_role, ...)
    kv_transfer_config: dict | str | None = None

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> "EngineConfig":
        """The config from keyword arguments. They go first to vLLM's names (ext/vllm_names.py, where installed), which
        translates or refuses those that are vLLM's (block_size, trust_remote_code, vLLM's options at their default)
        and leaves the others; a keyword left that is no field is an InvalidField naming it (checks.Settings)."""
        if vllm_names := find("vllm_names"):
            kwargs = vllm_names.engine_kwargs(kwargs)
        return cls(**kwargs)

    def __post_init__(self) -> None:
        # The checks run in this order, so a config with several faults names the first of them.
        self._check_paths()
        # the numbers in their LIMITS (threads: at most the machine's cores) and the flags (bools: a string "no" would
        # be truthy), each stored as a plain int or float; the seed is checked as a request's seed is
        threads_limits = {"low": 1, "high": os.cpu_count() or 1}
        check_numbers(self, LIMITS | {"threads": threads_limits})
        self.seed = SamplingParams(seed=self.seed).seed
        # dtype, device, kernels, kv_cache_dtype and the KV block size are among their CHOICES
        for name, allowed in CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise InvalidField(name, f"{shown(value)} is not one of {', '.join(map(str, allowed))}")
        self._resolve_device()
        self._resolve_kernels()  # and what they need of an fp8 KV cache
        # the fields that belong to an extension, each checked by it (and the extension refused by name if missing);
        # `extensions` names those this engine uses, for LLM to start each once it runs (ext/__init__.py)
        asked = extensions_asked(self, ENGINE_OPTIONS)
        for name, option in asked.items():
            load(name, option).check_config(self)
        self.extensions = tuple(asked)

    def _check_paths(self) -> None:
        """model, trace and tokenizer are None or a path (a pathlib.Path becomes its string; the trace's folder is
        checked by its extension, the tokenizer folder where it is loaded, before the weights)."""
        for name in ("model", "trace", "tokenizer"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, (str, os.PathLike)):
                    raise InvalidField(name, f"{shown(value)} is not a path")
                setattr(self, name, os.fspath(value))

    def _resolve_device(self) -> None:
        """device 'cuda' needs a visible GPU, and 'auto' becomes cuda when one is visible, else cpu. Then overlap and
        the step budget, where not given: their best value differs between a GPU and a CPU."""
        gpu_visible = torch.cuda.is_available()
        if self.device == "cuda" and not gpu_visible:
            raise InvalidField("device", "'cuda' but no GPU is visible to torch")
        if self.device == "auto":
            if gpu_visible:
                self.device = "cuda"
            else:
                self.device = "cpu"
        # the defaults whose best value differs between a GPU and a CPU
        if self.overlap is None:
            self.overlap = self.device == "cuda"
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = STEP_TOKENS[self.device]

    def _resolve_kernels(self) -> None:
        """kernels 'triton' needs the triton package, and on a CPU its interpreter; 'auto' becomes triton on cuda
        (when installed), else torch. Then enforce_eager on a CPU or with the PyTorch kernels: CUDA graphs need a GPU
        and the sync-free Triton kernels. Last, what kv_cache_dtype 'fp8' needs on a GPU, for the Triton kernels: float8
        e4m3 conversions, which NVIDIA GPUs have from sm_89 (Ada, Hopper) on."""
        if self.kernels == "triton" and not HAVE_TRITON:
            raise InvalidField("kernels", "'triton' needs the triton package (Linux only); use kernels='torch'")
        if self.kernels == "auto":
            if self.device == "cuda" and HAVE_TRITON:
                self.kernels = "triton"
            else:
                self.kernels = "torch"
        # whether TRITON_INTERPRET asks Triton to run kernels in its CPU interpreter (read now, not at import)
        interpreted = os.environ.get("TRITON_INTERPRET", "").lower() in TRITON_INTERPRET_ON
        if self.kernels == "triton" and self.device == "cpu" and not interpreted:
            raise InvalidField("kernels", "'triton' on a CPU needs TRITON_INTERPRET=1 set before nanoserve is imported")
        # CUDA graphs need a GPU and kernels that never wait for the host: the fused Triton kernels (the references'
        # K/V store picks its rows on the host)
        if self.device == "cpu" or self.kernels == "torch" or find("fused_kernels") is None:
            self.enforce_eager = True
        # (torch has float8 types from 2.1; pyproject asks for 2.5+)
        fp8_in_triton_on_gpu = self.kv_cache_dtype == "fp8" and self.kernels == "triton" and self.device == "cuda"
        if fp8_in_triton_on_gpu and torch.cuda.get_device_capability() < (8, 9):
            raise InvalidField("kv_cache_dtype", "'fp8' needs an sm_89+ GPU for the Triton kernels: kernels='torch'")

    def kv_cache_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's element type: the model's, or float8 e4m3 for 'fp8'."""
        if self.kv_cache_dtype == "fp8":
            return torch.float8_e4m3fn
        return model_dtype

    def torch_dtype(self, hf_config: "PretrainedConfig") -> torch.dtype:
        """The serving dtype: the one asked for; 'auto' is float32 on a CPU, and on a GPU float16 for a float16
        checkpoint, else bfloat16 (the checkpoint's dtype: transformers reads config.json's `dtype`, or the older
        `torch_dtype`, into hf_config.dtype; None if the config does not say)."""
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if self.device == "cpu":
            return torch.float32
        if hf_config.dtype == torch.float16:
            return torch.float16
        return torch.bfloat16  # a bf16 checkpoint's too
