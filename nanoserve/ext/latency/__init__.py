"""An extension: batch 1 is a launch-latency problem. `LLM(..., latency_kernels=True)`.

At batch 1 a decode step should be bound by reading the weights once: Qwen3-0.6B's 1.19 GB take 0.40 ms at an H100's
3 TB/s, the floor. The first H100 run (2026-11-27) measured 1.41 ms per step, wall, with 1.24 ms of GPU time spread
over ~280 kernels, most of them 2-6 us long. The weight GEMMs alone took 0.78 ms: 84 small cuBLAS kernels of ~5.8 us,
28 split-K reduction kernels and a 110 us LM head, 1.5 TB/s, half the copy bandwidth. Per layer the rest was small
kernels too: decode attention 4.6 us and its reduce 2.3 us, two add + RMSNorms of 1.6 us, QK-norm + RoPE 2.5 us,
SiLU-and-mul 1.1 us. With one token of work per kernel, each kernel's fixed costs dominate its work: the launch gap
between kernels (~0.6 us each inside a CUDA graph), and each kernel's ramp (its first DRAM round trip, with nothing
streaming yet) and tail (its last programs, and any reduction, with the DRAM idle). The textbook kernels the core
runs are right for big batches, where each kernel has work enough to hide these costs. This extension removes them
where batch 1 pays for them, with three tricks:
  1. the few-row GEMV (gemv.py): every projection of a step of at most 16 rows (q|k|v, o, gate|up, down, the LM head)
     reads its weight with a split-K GEMV that fills the GPU with enough reads in flight to stream at full bandwidth,
     and whose last program to finish a tile sums the splits' partials: no split-K reduction kernel (28 a step);
  2. fusions that ride in it: SiLU-and-mul in the down projection's input load (28 kernels a step gone; not under
     LoRA, whose adapters read SiLU-and-mul's output); and in decode attention (decode.py), the reduce merged into the
     last split to finish (28 kernels a step gone, the 2.3 us per layer);
  3. programmatic dependent launch (sm_90 and later): each GEMV and each decode attention kernel lets the next kernel
     start before it ends, so the next kernel's programs are placed, and the GEMV's prefetch their weights into L2,
     while the kernel before still runs: the launch gap and the first DRAM round trip hidden at each boundary.
Tricks 1 and 2 coordinate programs through memory (an arrival counter per output tile, or per sequence and KV head:
the last program to arrive finishes the work), which Triton's CPU interpreter, running programs one at a time, never
exercises: only a GPU run shows that they are right. So the extension is off by default until a GPU run measures it
correct and faster (gpu_check.sh's first stage: the GPU tests with a stress test of every counter, then the standard
workload, batch-1 latency and the attention rows, the default and this extension side by side).

Wiring, only through the core's declared points, when the engine starts (before it captures its decode graphs):
CausalLM.wrap_projections wraps each projection in a FewRowLinear (the LM head too), and CausalLM.replace_kernels
puts this extension's decode attention into the kernel table (kernels="triton"), and the identity in place of
SiLU-and-mul (the down projection applies it). On kernels="torch" the projections take the GEMV's PyTorch reference,
and attention stays the core's reference. Tensor parallelism is refused (a sharded projection joins its ranks'
results after its matmul, which the wrapper would skip); LoRA, which starts after this, wraps the wrapped projections.

Dropped when ext/gemv.py and ext/gemv_fusions.py became this extension (git history has them at 86468e8): the
residual add + RMSNorm moved into q|k|v's and gate|up's input load (NormIntoProjection, the NORM_INPUT kernel path),
and the QK-norm + RoPE + K/V store in q|k|v's epilogue (RotatingAttention, the ROTATE path). They were never measured
on a GPU, and the one idea fits its budget without them; they are the next fusions to measure once this one is."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor, nn

from nanoserve.attention import num_sms
from nanoserve.checks import InvalidField, check_flag
from nanoserve.config import EngineConfig
from nanoserve.ext.latency.decode import DecodeAttention
from nanoserve.ext.latency.gemv import FewRowLinear, Workspace, warm_up

if TYPE_CHECKING:
    from nanoserve.llm import LLM

FIELD = "latency_kernels"


def check_config(config: EngineConfig) -> None:
    check_flag(FIELD, config.latency_kernels)
    if config.tensor_parallel_size > 1:
        raise InvalidField(FIELD, "nanoserve runs the latency kernels at tensor_parallel_size=1 only")


@dataclass
class LatencyKernels:
    """An engine's latency kernels (llm.extensions["latency"]): the projections' wrappers and their shared GEMV
    workspace, and the decode attention in the kernel table (None on kernels="torch", which keeps the core's)."""

    projections: list[FewRowLinear]
    workspace: Workspace
    attention: DecodeAttention | None


def start(llm: "LLM") -> LatencyKernels:
    """The engine starts with the latency kernels: its projections wrapped, its kernel table changed."""
    model = llm.runner.model
    device = llm.runner.device
    use_kernel = model.kernels.name == "triton"
    workspace = Workspace(device)
    # the down projection applies SiLU-and-mul to [gate | up] (the table's own function for more rows), unless LoRA's
    # adapters, which read SiLU-and-mul's output, will wrap it
    fuse_silu = "lora" not in llm.config.extensions
    projections = []

    def wrap(layer: int | None, name: str, projection: nn.Module) -> FewRowLinear:
        silu_and_mul = None
        if fuse_silu and name == "down_proj":
            silu_and_mul = model.kernels.silu_and_mul
        projections.append(FewRowLinear(projection, workspace, num_sms(device), use_kernel, silu_and_mul))
        return projections[-1]

    model.wrap_projections(wrap)
    if device.type == "cuda":
        warm_up(projections)
    changes = {}
    if fuse_silu:
        changes["silu_and_mul"] = gate_and_up
    attention = None
    if use_kernel:
        attention = DecodeAttention(device, workspace.dependent_launch)
        changes["paged_attention"] = attention
    model.replace_kernels(**changes)
    return LatencyKernels(projections, workspace, attention)


def gate_and_up(x: Tensor) -> Tensor:
    """The kernel table's SiLU-and-mul where the down projection applies it: gate|up's output, unchanged."""
    return x
