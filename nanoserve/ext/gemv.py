"""An extension: a weight-read path for few rows, `LLM(..., small_batch_gemv=True)`. At batch 1 a decode step is
bound by reading the weights once: Qwen3-0.6B's 1.19 GB take 0.40 ms at the H100's 3 TB/s, yet the first H100 run
measured 0.78 ms in the weight GEMMs alone (84 small cuBLAS kernels of ~5.8 us, 28 split-K reductions, a 110 us LM head:
1.5 TB/s, half the copy bandwidth). With one to a few rows a matmul is a matrix-vector product (a GEMV): every weight
is read once and used for one multiply-add per row, so the only aim is to stream the weight at full bandwidth.

How the kernel below does it, for y [rows, out] = x [rows, in] @ W [out, in]^T (+ bias), rows <= MAX_ROWS:
  1. enough reads in flight: the output features are cut into tiles of BLOCK_N, and where that gives too few programs
     to fill the GPU (an o or down projection has 1,024 outputs: 32 tiles for 132 SMs) the inner dimension is cut into
     SPLIT_K parts too (split-K), until about PROGRAMS_PER_SM programs per SM (`plan`). Each program streams its
     [BLOCK_N, in / SPLIT_K] slice of W in [BLOCK_N, BLOCK_K] tiles, which Triton's software pipeline loads ahead of
     use, and multiplies them by the few rows of x (padded to a tile of MAX_ROWS rows: tensor cores are idle anyway);
  2. no second kernel for split-K: each program writes its fp32 partial sums to a workspace and adds one to its tile's
     counter; the program that arrives last (the counter's old value is SPLIT_K - 1) sums the SPLIT_K partials in
     split order, adds the bias, writes y and sets the counter back to 0 for the next launch. The sum's order never
     depends on which program came last, so the result is deterministic. The counter's atomic add is acquire-release
     at GPU scope: the partials a program stored before it are visible to the program that reads them after it (a
     barrier first, so all of the program's threads have stored; the reads bypass L1 too, `.cg`, which the acquire
     makes unnecessary: a second guard, kept);
  3. what the layer does next to the few rows can ride along (ext/gemv_fusions.py, this extension's second half): the
     SiLU-and-mul in the down projection's input load, the residual add + RMSNorm in q|k|v's and gate|up's, and
     Qwen3's QK-norm + RoPE with the K/V store in q|k|v's epilogue (the ROTATE variant: the grid's last tile to be
     written does every row's heads). One launch fewer per layer each. Not under LoRA, whose adapters read what
     they no longer produce;
  4. no gap between one projection and the next (sm_90 and later): the kernel is launched as a programmatic
     dependent of the kernel before it (CUDA's programmatic dependent launch, PDL). Each program first says that the
     next kernel may start (griddepcontrol.launch_dependents), so that kernel's programs are placed on the SMs while
     this one still runs; there they ask L2 to fetch the first PREFETCH_LINES 128-byte lines of each of their weight
     rows, the one input that no earlier kernel writes, and then wait (griddepcontrol.wait) until the kernel before
     has finished and its writes are visible. Nothing is read or written before that wait but the prefetch. What it
     saves at each projection that follows another: the launch, and the first DRAM round trip (the software
     pipeline's first tiles come from L2), about 1-2 us of a 3-6 us kernel at batch 1. The layer's attention, between
     q|k|v's GEMV and o's, is asked to launch the same way (the core's paged_attention(..., dependent=True): its
     decode kernel lets go first and waits before its first load), so o's programs prefetch their weight while
     attention runs. Kernels that do not say so (torch's, the core's others) start their dependents at their end, as
     a plain launch would: correct, no gain.
More rows than MAX_ROWS (prefill, big batches) go to the base projection's torch matmul (cuBLAS), as before.

Why a Triton kernel rather than a better cuBLAS (or cuBLASLt) configuration: cuBLASLt can be told a split-K factor and
a reduction scheme, but only through its C API's algorithm preferences; torch picks the algorithm per call by its own
heuristics and gives Python no handle on either (its preferred_blas_library switches the library, not the algorithm),
so reaching them would need compiled code, which nanoserve does not ship. And a library call cannot do 3 above, which
saves launches, nor promise a fixed order of the split sums (cuBLAS's split-K reductions may use atomics).

The engine's start wraps every decoder projection (q|k|v, o, gate|up, down) and the LM head in a FewRowLinear and
captures the decode graphs again over them (the first capture saw cuBLAS). One workspace and one set of counters serve
every projection: kernels on one stream never overlap. On kernels="torch" the wrapper routes the same rows to
`gemv_ref`, the PyTorch reference the kernel is tested against. Tensor parallelism is refused (a sharded projection
joins its ranks' results after its matmul, which the wrapper would skip); LoRA wraps the wrapped projections."""

from collections.abc import Callable
from dataclasses import replace
from functools import partial
from itertools import product
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nanoserve.attention import PAD_SLOT, _num_sms, paged_attention
from nanoserve.checks import InvalidField, check_flag
from nanoserve.config import EngineConfig
from nanoserve.cuda_graphs import DecodeGraphs
from nanoserve.ext import gemv_fusions
from nanoserve.ext.gemv_fusions import (
    NormedRows,
    Rotation,
    fuse_into_layers,
    norm_args,
    normed_input_ref,
    rotate_and_store_ref,
    rotation_launch,
    warm_up_fusions,
)
from nanoserve.fused_ops import _norm_rope_heads, silu_and_mul_ref
from nanoserve.layers import MergedLinear
from nanoserve.triton_shim import tl, triton

if TYPE_CHECKING:
    from nanoserve.llm import LLM

FIELD = "small_batch_gemv"
MAX_ROWS = 16  # rows that take the GEMV: the smallest tile tl.dot takes, and where cuBLAS's GEMMs stop being GEMVs
BLOCK_N = 32  # output features per program
BLOCK_K = 128  # inner elements per loaded tile: a [32, 128] bf16 tile is 8 KiB, 64 bytes per thread of 4 warps
PROGRAMS_PER_SM = 2  # split-K until the grid has about this many programs per SM
MIN_SPLIT_TILES = 2  # ... while each split still streams at least this many tiles
NUM_WARPS, NUM_STAGES = 4, 3
DEPENDENT_LAUNCH = True  # 4. in the module's docstring, where the GPU has it (False: every launch a plain one)
PREFETCH_LINES = 4  # 128-byte lines of each weight row that a waiting program asks L2 for (bf16: 2 tiles of BLOCK_K)
# the projections wrapped in each decoder layer, (module, name); and the LM head
PROJECTIONS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


def check_config(config: EngineConfig) -> None:
    check_flag(FIELD, config.small_batch_gemv)
    if config.tensor_parallel_size > 1:
        raise InvalidField(FIELD, "nanoserve reads weights with the GEMV at tensor_parallel_size=1 only")


def start(llm: "LLM") -> None:
    """The engine starts with the GEMV on: its projections wrapped, the decode graphs captured again over them."""
    runner = llm.runner
    model = runner.model
    named = [(getattr(layer, part), name) for layer in model.model.layers for part, name in PROJECTIONS]
    named.append((model, "lm_head"))
    num_sms = _num_sms(runner.device)
    plans = [plan(*getattr(parent, name).weight.shape, num_sms) for parent, name in named]
    workspace = Workspace(plans, runner.device)
    use_kernel = llm.config.kernels == "triton"
    wrapped = []
    for (parent, name), (split_k, _) in zip(named, plans, strict=True):
        wrapped.append(FewRowLinear(getattr(parent, name), split_k, workspace, use_kernel))
        setattr(parent, name, wrapped[-1])
    if "lora" not in llm.config.extensions:  # (LoRA's adapters read SiLU-and-mul's output and the normed input)
        fuse_into_layers(model)  # ext/gemv_fusions.py
    for attn in (layer.self_attn for layer in model.model.layers):  # attention, between q|k|v's GEMV and o's, a
        # dependent too (4. above): in the kernel table of the attention module, which calls it
        if workspace.dependent_launch and attn.kernels.paged_attention is paged_attention:
            attn.kernels = replace(attn.kernels, paged_attention=partial(paged_attention, dependent=True))
    if runner.device.type == "cuda":  # every build the kernel needs, now, not in a step (the LM head runs eagerly):
        # 1, some and MAX_ROWS rows (Triton compiles apart for an int equal to 1, or divisible by 16)
        for module, rows in product(wrapped, (1, 2, MAX_ROWS)):
            module(module.weight.new_zeros(rows, module.in_features * (2 if module.silu_and_mul else 1)))
        warm_up_fusions(model, runner.kv_caches[0])  # and the builds of ext/gemv_fusions.py's fusions
    if runner.graphs is not None:  # the old graphs (and their pool) go first
        runner.graphs = None
        torch.cuda.empty_cache()
        runner.graphs = DecodeGraphs(model, runner.kv_caches, llm.config.max_num_seqs, runner.max_blocks_per_seq)
        runner.graphs.capture()


def plan(out_features: int, in_features: int, num_sms: int) -> tuple[int, int]:
    """(SPLIT_K, programs) for a projection of this shape on num_sms SMs: the inner dimension split in two until the
    grid has PROGRAMS_PER_SM programs per SM, or until a split would stream fewer than MIN_SPLIT_TILES tiles."""
    tiles = -(-out_features // BLOCK_N)
    split_k = 1
    while tiles * split_k < PROGRAMS_PER_SM * num_sms and in_features >= 2 * split_k * MIN_SPLIT_TILES * BLOCK_K:
        split_k *= 2
    return split_k, tiles * split_k


class Workspace:
    """The split-K partial sums ([SPLIT_K, MAX_ROWS, out] fp32, as one flat buffer), sized for the largest projection
    that splits, and the arrival counters (int32, zero between launches): one per tile of the projection with the most
    tiles, and one after a projection's tiles for a rotation's count of tiles written (ext/gemv_fusions.py). Every
    wrapped projection shares them. plans: each projection's (SPLIT_K, programs)."""

    def __init__(self, plans: list[tuple[int, int]], device: torch.device) -> None:
        split = [(s, p) for s, p in plans if s > 1] or [(1, 1)]
        self.partials = torch.empty(max(p * BLOCK_N * MAX_ROWS for _, p in split), dtype=torch.float32, device=device)
        self.counters = torch.zeros(max(p // s for s, p in plans) + 1, dtype=torch.int32, device=device)
        self.dependent_launch = dependent_launch(device)


def dependent_launch(device: torch.device) -> bool:
    """Whether the kernel launches as a programmatic dependent on this device: CUDA's sm_90 (Hopper) and later."""
    on_nvidia = device.type == "cuda" and torch.version.hip is None  # (ROCm's MI300 reports capability 9.4)
    return DEPENDENT_LAUNCH and on_nvidia and torch.cuda.get_device_capability(device)[0] >= 9


class FewRowLinear(nn.Module):
    """A projection whose forward reads its weight with the GEMV for at most MAX_ROWS rows, and with the base
    projection's own forward otherwise. The base keeps its parameters (and their names' place in the checkpoint)."""

    def __init__(self, base: nn.Linear, split_k: int, workspace: Workspace, use_kernel: bool) -> None:
        super().__init__()
        self.base = base
        self.split_k = split_k
        self.workspace = workspace
        self.gemv = gemv if use_kernel else gemv_ref
        # a down projection's: the kernel table's SiLU-and-mul, which its input [gate | up] still needs
        # (fuse_silu_into_down); None: the input is the projection's own
        self.silu_and_mul: Callable | None = None
        if isinstance(base, MergedLinear):
            self.shard_sizes = base.shard_sizes  # the model splits q|k|v by these

    @property
    def weight(self) -> nn.Parameter:
        return self.base.weight

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: Tensor | NormedRows, rotation: Rotation | None = None) -> Tensor:
        silu = self.silu_and_mul is not None
        if len(x) > MAX_ROWS:
            return self.base(self.silu_and_mul(x) if silu else x)
        return self.gemv(x, self.base.weight, self.base.bias, self.split_k, self.workspace, silu, rotation)


def gemv_ref(
    x: Tensor | NormedRows,
    weight: Tensor,
    bias: Tensor | None,
    split_k: int,
    workspace: Workspace,
    silu_input: bool = False,
    rotation: Rotation | None = None,
) -> Tensor:
    """The kernel's PyTorch reference: torch's own x @ weight^T (+ bias), in x's dtype (split_k and the workspace
    only shape the kernel's work, never its result); with silu_input, x is [gate | up] and the input is SiLU-and-mul
    of it; from NormedRows the input is its add + RMSNorm, the stream written; with a rotation, the output's q heads
    are normed and rotated and its K and V stored (the references of fused_ops and ext/gemv_fusions.py). No fp32 copy
    of the weight: the LM head's would be 0.6 GB."""
    x = normed_input_ref(x) if isinstance(x, NormedRows) else x
    y = F.linear(silu_and_mul_ref(x) if silu_input else x, weight, bias)
    if rotation is not None:
        rotate_and_store_ref(y, rotation)
    return y


def gemv(
    x: Tensor | NormedRows,
    weight: Tensor,
    bias: Tensor | None,
    split_k: int,
    workspace: Workspace,
    silu_input: bool = False,
    rotation: Rotation | None = None,
) -> Tensor:
    """x [rows <= MAX_ROWS, in] @ weight [out, in]^T (+ bias [out]) -> [rows, out] in x's dtype, by _gemv_kernel; with
    silu_input, x is [rows, 2 in] = [gate | up] and the input is silu(gate) * up, made as the kernel loads it; from
    NormedRows the input is RMSNorm(x + residual) * weight, and x + residual is written into its stream; with a
    rotation (at most ROTATE_MAX_ROWS rows), the output is q|k|v, whose q and k heads the kernel's last program norms
    and rotates in place, and whose K and V it stores into the caches (ext/gemv_fusions.py)."""
    normed = x if isinstance(x, NormedRows) else None
    x = x if normed is None else normed.x
    rows = len(x)
    out_features, in_features = weight.shape
    assert rows <= MAX_ROWS and x.stride(1) == 1 and weight.stride(1) == 1, "rows over MAX_ROWS, or strided rows"
    assert x.shape[1] == in_features * (2 if silu_input else 1), "x's columns: in, or gate and up"
    if normed is not None:
        streams = (normed.residual, normed.stream)
        assert all(t.shape == x.shape and t.stride(1) == 1 for t in streams), "residual, stream: x's shape, dense rows"
        assert normed.weight.shape == (in_features,) and normed.weight.is_contiguous() and not silu_input
    assert rotation is None or rows <= gemv_fusions.ROTATE_MAX_ROWS, "a rotation's rows are done one by one: a few"
    y = x.new_empty(rows, out_features)
    rotation_args, rotation_sizes = rotation_launch(rotation, y)
    # each split's share of the inner dimension, in whole tiles, so the splits never overlap
    k_per_split = triton.cdiv(triton.cdiv(in_features, split_k), BLOCK_K) * BLOCK_K
    grid = (triton.cdiv(out_features, BLOCK_N), split_k)
    _gemv_kernel[grid](
        x,
        weight,
        weight if bias is None else bias,  # (never read without a bias)
        y,
        workspace.partials,
        workspace.counters,
        *(norm_args(normed) if normed is not None else (x, x, 0, 0, x, 0.0)),  # (never read without a norm)
        rows,
        out_features,
        in_features,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        *rotation_args,
        HAS_BIAS=bias is not None,
        SILU_INPUT=silu_input,
        NORM_INPUT=normed is not None,
        NORM_TILES=triton.cdiv(in_features, BLOCK_K) if normed is not None else 1,  # (1: one build without)
        **rotation_sizes,
        PAD=PAD_SLOT,
        SPLIT_K=split_k,
        K_PER_SPLIT=k_per_split,
        BLOCK_M=MAX_ROWS,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        DEPENDENT=workspace.dependent_launch,
        PREFETCH_LINES=PREFETCH_LINES,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
        launch_pdl=workspace.dependent_launch,
    )
    return y


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    partials_ptr,
    counters_ptr,
    residual_ptr,
    stream_ptr,
    stride_r,
    stride_s,
    norm_w_ptr,
    eps,
    rows,
    N,
    K,
    stride_x,
    stride_w,
    stride_y,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    q_norm_ptr,
    k_norm_ptr,
    qk_eps,
    stride_cb,
    stride_cs,
    stride_ch,
    num_q_heads,
    num_kv_heads,
    HAS_BIAS: tl.constexpr,
    SILU_INPUT: tl.constexpr,
    NORM_INPUT: tl.constexpr,
    NORM_TILES: tl.constexpr,
    ROTATE: tl.constexpr,
    HALF: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    PAD: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DEPENDENT: tl.constexpr,
    PREFETCH_LINES: tl.constexpr,
):
    """Program (tile, split): output features [tile * BLOCK_N, +BLOCK_N) over inner elements [split * K_PER_SPLIT,
    +K_PER_SPLIT); the last of a tile's SPLIT_K programs to finish writes the tile's output."""
    tile = tl.program_id(0)
    split = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_w  # [BLOCK_N, 1]: 64-bit, a weight may pass 2^31 elements
    if DEPENDENT:  # launched as a programmatic dependent (4. in the module's docstring)
        tl.extra.cuda.gdc_launch_dependents()
        line = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth  # elements per 128-byte line (1,024 bits)
        lines = tl.minimum(split * K_PER_SPLIT + tl.arange(0, PREFETCH_LINES) * line, K - 1)  # (all in the weight)
        _prefetch_into_l2(w_ptr + tl.minimum(n, N - 1)[:, None].to(tl.int64) * stride_w + lines[None, :])
        tl.extra.cuda.gdc_wait()  # the kernel before has finished: x, the workspace and y are safe to touch
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if NORM_INPUT:  # each row's 1 / RMS(x + residual); program (0, 0) writes the stream x + residual
        first = (tile == 0) & (split == 0)
        inv_rms = _add_and_inv_rms(
            x_ptr, residual_ptr, stream_ptr, stride_x, stride_r, stride_s, eps, m, rows, K, first, BLOCK_K, NORM_TILES
        )
    for k0 in range(split * K_PER_SPLIT, (split + 1) * K_PER_SPLIT, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x_at = x_ptr + m[:, None] * stride_x + k[None, :]
        x_mask = (m[:, None] < rows) & (k[None, :] < K)
        x = tl.load(x_at, mask=x_mask, other=0.0)
        if SILU_INPUT:  # x's rows are [gate | up]: this is gate; silu(gate) * up, rounded as the SiLU kernel rounds
            g = x.to(tl.float32)
            x = (g / (1.0 + tl.exp(-g))).to(x.dtype) * tl.load(x_at + K, mask=x_mask, other=0.0)
        if NORM_INPUT:  # RMSNorm(x + residual) * weight, rounded as the add + RMSNorm kernel rounds
            stream = x + tl.load(residual_ptr + m[:, None] * stride_r + k[None, :], mask=x_mask, other=0.0)
            norm_w = tl.load(norm_w_ptr + k, mask=k < K, other=0.0)
            x = (stream.to(tl.float32) * inv_rms[:, None]).to(x.dtype) * norm_w[None, :]
        w = tl.load(w_rows + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")  # (fp32 weights: no TF32 rounding)
    out_mask = (m[:, None] < rows) & (n[None, :] < N)
    wrote = True  # this program wrote its tile's output
    if SPLIT_K == 1:
        _write_rows(acc, bias_ptr, y_ptr, stride_y, m, n, N, out_mask, HAS_BIAS)
    else:
        # this split's partial sums, then its arrival on the tile's counter (see the module's docstring)
        partials = partials_ptr + (split * BLOCK_M + m[:, None]) * N + n[None, :]
        tl.store(partials, acc, mask=out_mask)
        tl.debug_barrier()  # every thread of the program has stored before the counter says so
        arrived = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel", scope="gpu")
        wrote = arrived == SPLIT_K - 1
        if wrote:  # the tile's last program: every split's partials are in
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT_K):  # in split order, whichever program came last
                part = partials_ptr + (s * BLOCK_M + m[:, None]) * N + n[None, :]
                total += tl.load(part, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(counters_ptr + tile, 0)  # ready for the next launch (a graph replays this one)
            _write_rows(total, bias_ptr, y_ptr, stride_y, m, n, N, out_mask, HAS_BIAS)
    if ROTATE:  # y is q|k|v: the grid's last tile to be written rotates every row's heads, stores its K and V
        if wrote:
            done = counters_ptr + tl.num_programs(0)  # (after the tiles' own counters)
            tl.debug_barrier()  # every thread of the program has stored its tile before the counter says so
            if tl.atomic_add(done, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
                tl.store(done, 0)
                for r in range(rows):  # as fused_ops._qk_norm_rope_store_kernel does for token r, on y's row r
                    cos_row = tl.load(positions_ptr + r) * HALF + tl.arange(0, HALF)[None, :]
                    cos, sin = tl.load(cos_ptr + cos_row), tl.load(sin_ptr + cos_row)
                    q_at = y_ptr + r * stride_y
                    k_at = q_at + num_q_heads * 2 * HALF
                    _norm_rope_heads(q_at, 2 * HALF, num_q_heads, q_norm_ptr, cos, sin, qk_eps, Q_HEADS_PAD, HALF)
                    k1, k2 = _norm_rope_heads(
                        k_at, 2 * HALF, num_kv_heads, k_norm_ptr, cos, sin, qk_eps, K_HEADS_PAD, HALF
                    )
                    slot = tl.load(slot_mapping_ptr + r).to(tl.int64)
                    h, d = tl.arange(0, K_HEADS_PAD)[:, None], tl.arange(0, HALF)[None, :]
                    mask = h < tl.where(slot == PAD, 0, num_kv_heads)  # a padded row stores no head
                    dst = (slot // CACHE_BLOCK) * stride_cb + (slot % CACHE_BLOCK) * stride_cs + h * stride_ch + d
                    v = k_at + (num_kv_heads + h) * 2 * HALF + d  # each V head's first half
                    tl.store(k_cache_ptr + dst, k1, mask=mask)
                    tl.store(k_cache_ptr + dst + HALF, k2, mask=mask)
                    tl.store(v_cache_ptr + dst, tl.load(v, mask=mask), mask=mask)
                    tl.store(v_cache_ptr + dst + HALF, tl.load(v + HALF, mask=mask), mask=mask)


@triton.jit
def _prefetch_into_l2(pointers):
    """Ask L2 for the 128-byte line at each pointer (a hint: nothing waits for it, nothing is returned)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [pointers], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _add_and_inv_rms(
    x_ptr,
    residual_ptr,
    stream_ptr,
    stride_x,
    stride_r,
    stride_s,
    eps,
    m,
    rows,
    K,
    write_stream,
    BLOCK_K: tl.constexpr,
    NORM_TILES: tl.constexpr,
):
    """[BLOCK_M] 1 / sqrt(mean((x + residual)^2) + eps) over the whole of each row (K elements in NORM_TILES tiles),
    the sum in the model dtype and the statistic in fp32, as the add + RMSNorm kernel computes them
    (fused_ops._add_rms_norm_kernel: a change to its rounding belongs here too, and in the GEMV's load); with
    write_stream, the sum is stored into the stream too. The first loop is unrolled and only loads (a store might
    alias a later load, which could then not be issued before it), so that all its loads can be in flight at once;
    squares are summed across the row once, at the end. The stream's program loads again to store: from L1."""
    squares = tl.zeros([m.shape[0], BLOCK_K], tl.float32)
    for t in tl.static_range(NORM_TILES):
        stream = _row_sum_tile(x_ptr, residual_ptr, stride_x, stride_r, m, t * BLOCK_K, rows, K, BLOCK_K)
        squares += stream.to(tl.float32) * stream.to(tl.float32)
    if write_stream:
        for t in tl.static_range(NORM_TILES):
            k = t * BLOCK_K + tl.arange(0, BLOCK_K)
            stream = _row_sum_tile(x_ptr, residual_ptr, stride_x, stride_r, m, t * BLOCK_K, rows, K, BLOCK_K)
            tl.store(
                stream_ptr + m[:, None] * stride_s + k[None, :], stream, mask=(m[:, None] < rows) & (k[None, :] < K)
            )
    sum_sq = tl.sum(squares, 1)
    return 1.0 / tl.sqrt(sum_sq / K + eps)


@triton.jit
def _row_sum_tile(x_ptr, residual_ptr, stride_x, stride_r, m, k0, rows, K, BLOCK_K: tl.constexpr):
    """x + residual on rows m, columns [k0, k0 + BLOCK_K), in the model dtype (0 outside the rows and K)."""
    k = k0 + tl.arange(0, BLOCK_K)
    mask = (m[:, None] < rows) & (k[None, :] < K)
    x = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=mask, other=0.0)
    return x + tl.load(residual_ptr + m[:, None] * stride_r + k[None, :], mask=mask, other=0.0)


@triton.jit
def _write_rows(acc, bias_ptr, y_ptr, stride_y, m, n, N, out_mask, HAS_BIAS: tl.constexpr):
    """A tile's sums, plus the bias, into y in y's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * stride_y + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_mask)
