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
     barrier first, so all of the program's threads have stored; the reads bypass L1, which may hold the workspace's
     lines from an earlier launch);
  3. an elementwise op can ride in the input load: the layer's SiLU-and-mul moves into its down projection, which reads
     gate and up and forms silu(gate) * up as it loads x (`fuse_silu_into_down`; one launch fewer per layer). Not under
     LoRA, whose down adapter reads the SiLU's output itself;
  4. so can the residual add and RMSNorm before q|k|v and before gate|up (`fuse_norms_into_projections`; two launches
     fewer per layer): the layer's norm hands on a NormedRows (its two inputs, nothing computed), and the projection's
     programs each first read the whole rows of x + residual (4 KiB a row at Qwen3-0.6B's width, from L2) for their
     mean square, then form RMSNorm(x + residual) * weight as they load each tile; program (0, 0) also writes
     x + residual, the next residual stream, into a fresh tensor (the other programs are still reading the old one).
     Every program redoing the mean square reads, per row, a quarter to an eighth of the bytes of its weight slice
     again (from L2, not memory): cheap beside a ~1.6 us launch for a row or a few, not for 16, so only steps of at
     most NORM_MAX_ROWS rows do it. Not under LoRA either (its adapters read the normed input).
More rows than MAX_ROWS (prefill, big batches) go to the base projection's torch matmul (cuBLAS), as before.

Why a Triton kernel rather than a better cuBLAS (or cuBLASLt) configuration: cuBLASLt can be told a split-K factor and
a reduction scheme, but only through its C API's algorithm preferences; torch picks the algorithm per call by its own
heuristics and gives Python no handle on either (its preferred_blas_library switches the library, not the algorithm),
so reaching them would need compiled code, which nanoserve does not ship. And a library call cannot do 3 and 4 above,
which save a launch each, nor promise a fixed order of the split sums (cuBLAS's split-K reductions may use atomics).

The engine's start wraps every decoder projection (q|k|v, o, gate|up, down) and the LM head in a FewRowLinear and
captures the decode graphs again over them (the first capture saw cuBLAS). One workspace and one set of counters serve
every projection: kernels on one stream never overlap. On kernels="torch" the wrapper routes the same rows to
`gemv_ref`, the PyTorch reference the kernel is tested against. Tensor parallelism is refused (a sharded projection
joins its ranks' results after its matmul, which the wrapper would skip); LoRA wraps the wrapped projections."""

from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import product
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nanoserve.attention import _num_sms
from nanoserve.checks import InvalidField, check_flag
from nanoserve.config import EngineConfig
from nanoserve.cuda_graphs import DecodeGraphs
from nanoserve.fused_ops import add_rms_norm_ref, silu_and_mul_ref
from nanoserve.layers import MergedLinear
from nanoserve.triton_shim import tl, triton

if TYPE_CHECKING:
    from nanoserve.llm import LLM

FIELD = "small_batch_gemv"
MAX_ROWS = 16  # rows that take the GEMV: the smallest tile tl.dot takes, and where cuBLAS's GEMMs stop being GEMVs
NORM_MAX_ROWS = 4  # rows whose add + RMSNorm the GEMV forms in its load (more: the norm's own kernel; see 4 above)
# the widest rows whose mean square the GEMV takes: its loop over a row's tiles is unrolled to keep their loads in
# flight together, and the registers grow with the width (sm_90, bf16, triton 3.6: 90 at 1,024, 134 at 4,096, 214 at
# 8,192, where only 2 programs fit an SM): wider rows are left to the norm's own kernel until a GPU run says otherwise
NORM_MAX_WIDTH = 4096
BLOCK_N = 32  # output features per program
BLOCK_K = 128  # inner elements per loaded tile: a [32, 128] bf16 tile is 8 KiB, 64 bytes per thread of 4 warps
PROGRAMS_PER_SM = 2  # split-K until the grid has about this many programs per SM
MIN_SPLIT_TILES = 2  # ... while each split still streams at least this many tiles
NUM_WARPS, NUM_STAGES = 4, 3
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
        for layer in model.model.layers:
            fuse_silu_into_down(layer)
            if model.args.hidden_size <= NORM_MAX_WIDTH:
                fuse_norms_into_projections(layer)
    if runner.device.type == "cuda":  # every build the kernel needs, now, not in a step (the LM head runs eagerly):
        # 1, some and MAX_ROWS rows (Triton compiles apart for an int equal to 1, or divisible by 16); with the norm
        # in the load (at most NORM_MAX_ROWS rows), 1 and some
        for module, rows in product(wrapped, (1, 2, MAX_ROWS)):
            module(module.weight.new_zeros(rows, module.in_features * (2 if module.silu_and_mul else 1)))
        for module, rows in product(fed_by_norms(model), (1, 2)):
            zeros = module.weight.new_zeros(rows, module.in_features)
            module(NormedRows(zeros, zeros, torch.empty_like(zeros), zeros[0], 1e-6))
    if runner.graphs is not None:  # the old graphs (and their pool) go first
        runner.graphs = None
        torch.cuda.empty_cache()
        runner.graphs = DecodeGraphs(model, runner.kv_caches, llm.config.max_num_seqs, runner.max_blocks_per_seq)
        runner.graphs.capture()


def fuse_silu_into_down(layer: nn.Module) -> None:
    """The layer's SiLU-and-mul moves into its down projection's input load: the layer's kernel table hands the MLP's
    gate|up on whole (`gate_and_up`), and the down projection's wrapper applies SiLU-and-mul to it, inside the GEMV's
    load for few rows (one launch fewer per layer), or with the table's own kernel before cuBLAS for more."""
    layer.mlp.down_proj.silu_and_mul = layer.kernels.silu_and_mul
    layer.kernels = replace(layer.kernels, silu_and_mul=gate_and_up)


def gate_and_up(x: Tensor) -> Tensor:
    """The kernel table's SiLU-and-mul in a layer whose down projection applies it: gate|up, unchanged."""
    return x


def fuse_norms_into_projections(layer: nn.Module) -> None:
    """The layer's two add + RMSNorms move into the projections that read their outputs: input_layernorm's into q|k|v,
    post_attention_layernorm's into gate|up (for at most NORM_MAX_ROWS rows; with more, each norm runs its own
    kernel, as before)."""
    layer.input_layernorm = NormIntoProjection(layer.input_layernorm)
    layer.post_attention_layernorm = NormIntoProjection(layer.post_attention_layernorm)


def fed_by_norms(model: nn.Module) -> list[nn.Module]:
    """The projections that take a NormedRows: q|k|v and gate|up of each layer whose norms moved into them."""
    layers = [layer for layer in model.model.layers if isinstance(layer.input_layernorm, NormIntoProjection)]
    return [proj for layer in layers for proj in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj)]


@dataclass
class NormedRows:
    """A norm's output not yet computed, handed to the projection that reads it: the input is RMSNorm(x + residual) *
    weight, and x + residual (the next residual stream) goes into `stream`, written by the projection's GEMV."""

    x: Tensor  # [rows, hidden]: the previous sublayer's output
    residual: Tensor  # [rows, hidden]: the stream before it (read, never written)
    stream: Tensor  # [rows, hidden]: the stream after it, written by the projection
    weight: Tensor  # [hidden]: the norm's
    eps: float

    def __len__(self) -> int:
        return len(self.x)


class NormIntoProjection(nn.Module):
    """A decoder layer's add + RMSNorm (model.RMSNorm: forward(x, residual) -> (normed, stream)) that, for at most
    NORM_MAX_ROWS rows, computes nothing: it returns a NormedRows for the next projection's GEMV, and the fresh stream
    tensor the GEMV writes (the model carries it to the next norm, which runs after that GEMV).
    What this asks of the layer (model.DecoderLayer.forward, Attention.forward): the normed output goes to one
    projection and nowhere else, and the stream is read only after that projection has run. Both hold in the core's
    layer; a change there that reads the norm's output or the stream elsewhere must drop this fusion."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor | NormedRows, Tensor]:
        if len(x) > NORM_MAX_ROWS:
            return self.norm(x, residual)
        stream = torch.empty_like(residual)
        return NormedRows(x, residual, stream, self.norm.weight, self.norm.eps), stream


def plan(out_features: int, in_features: int, num_sms: int) -> tuple[int, int]:
    """(SPLIT_K, programs) for a projection of this shape on num_sms SMs: the inner dimension split in two until the
    grid has PROGRAMS_PER_SM programs per SM, or until a split would stream fewer than MIN_SPLIT_TILES tiles."""
    tiles = -(-out_features // BLOCK_N)
    split_k = 1
    while tiles * split_k < PROGRAMS_PER_SM * num_sms and in_features >= 2 * split_k * MIN_SPLIT_TILES * BLOCK_K:
        split_k *= 2
    return split_k, tiles * split_k


class Workspace:
    """The split-K partial sums ([SPLIT_K, MAX_ROWS, out] fp32, as one flat buffer) and per-tile arrival counters
    (int32, zero between launches) that every wrapped projection shares, sized for the largest that splits (an
    unsplit one, the LM head's 4,748 tiles, uses neither). plans: each projection's (SPLIT_K, programs)."""

    def __init__(self, plans: list[tuple[int, int]], device: torch.device) -> None:
        split = [(s, p) for s, p in plans if s > 1] or [(1, 1)]
        self.partials = torch.empty(max(p * BLOCK_N * MAX_ROWS for _, p in split), dtype=torch.float32, device=device)
        self.counters = torch.zeros(max(p // s for s, p in split), dtype=torch.int32, device=device)


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

    def forward(self, x: Tensor | NormedRows) -> Tensor:
        silu = self.silu_and_mul is not None
        if len(x) > MAX_ROWS:
            return self.base(self.silu_and_mul(x) if silu else x)
        return self.gemv(x, self.base.weight, self.base.bias, self.split_k, self.workspace, silu)


def gemv_ref(
    x: Tensor | NormedRows,
    weight: Tensor,
    bias: Tensor | None,
    split_k: int,
    workspace: Workspace,
    silu_input: bool = False,
) -> Tensor:
    """The kernel's PyTorch reference: torch's own x @ weight^T (+ bias), in x's dtype (split_k and the workspace
    only shape the kernel's work, never its result); with silu_input, x is [gate | up] and the input is SiLU-and-mul
    of it, and from NormedRows the input is its add + RMSNorm, the stream written (fused_ops' references). No fp32
    copy of the weight: the LM head's would be 0.6 GB."""
    if isinstance(x, NormedRows):
        normed, stream = add_rms_norm_ref(x.x, x.residual, x.weight, x.eps)
        x.stream.copy_(stream)
        x = normed
    return F.linear(silu_and_mul_ref(x) if silu_input else x, weight, bias)


def gemv(
    x: Tensor | NormedRows,
    weight: Tensor,
    bias: Tensor | None,
    split_k: int,
    workspace: Workspace,
    silu_input: bool = False,
) -> Tensor:
    """x [rows <= MAX_ROWS, in] @ weight [out, in]^T (+ bias [out]) -> [rows, out] in x's dtype, by _gemv_kernel; with
    silu_input, x is [rows, 2 in] = [gate | up] and the input is silu(gate) * up, made as the kernel loads it; from
    NormedRows the input is RMSNorm(x + residual) * weight, and x + residual is written into its stream."""
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
    y = x.new_empty(rows, out_features)
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
        *(_norm_args(normed) if normed is not None else (x, x, 0, 0, x, 0.0)),  # (never read without a norm)
        rows,
        out_features,
        in_features,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        SILU_INPUT=silu_input,
        NORM_INPUT=normed is not None,
        NORM_TILES=triton.cdiv(in_features, BLOCK_K) if normed is not None else 1,  # (1: one build without)
        SPLIT_K=split_k,
        K_PER_SPLIT=k_per_split,
        BLOCK_M=MAX_ROWS,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return y


def _norm_args(normed: NormedRows) -> tuple:
    """What the kernel takes of a NormedRows: the residual and stream and their row strides, the weight, eps."""
    residual, stream = normed.residual, normed.stream
    return residual, stream, residual.stride(0), stream.stride(0), normed.weight, normed.eps


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
    HAS_BIAS: tl.constexpr,
    SILU_INPUT: tl.constexpr,
    NORM_INPUT: tl.constexpr,
    NORM_TILES: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (tile, split): output features [tile * BLOCK_N, +BLOCK_N) over inner elements [split * K_PER_SPLIT,
    +K_PER_SPLIT); the last of a tile's SPLIT_K programs to finish writes the tile's output."""
    tile = tl.program_id(0)
    split = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_w  # [BLOCK_N, 1]: 64-bit, a weight may pass 2^31 elements
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
    if SPLIT_K == 1:
        _write_rows(acc, bias_ptr, y_ptr, stride_y, m, n, N, out_mask, HAS_BIAS)
    else:
        # this split's partial sums, then its arrival on the tile's counter (see the module's docstring)
        partials = partials_ptr + (split * BLOCK_M + m[:, None]) * N + n[None, :]
        tl.store(partials, acc, mask=out_mask)
        tl.debug_barrier()  # every thread of the program has stored before the counter says so
        arrived = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the tile's last program: every split's partials are in
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT_K):  # in split order, whichever program came last
                part = partials_ptr + (s * BLOCK_M + m[:, None]) * N + n[None, :]
                total += tl.load(part, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(counters_ptr + tile, 0)  # ready for the next launch (a graph replays this one)
            _write_rows(total, bias_ptr, y_ptr, stride_y, m, n, N, out_mask, HAS_BIAS)


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
