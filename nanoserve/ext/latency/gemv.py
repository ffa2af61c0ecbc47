"""The few-row weight read of ext/latency: a split-K GEMV for y [rows, out] = x [rows, in] @ W [out, in]^T (+ bias) at
rows <= MAX_ROWS, and FewRowLinear, the projection wrapper that sends those rows to it (more rows keep the base
projection's cuBLAS matmul). The package's docstring says why batch 1 needs it; here is how it works:
  1. enough reads in flight: the output features are cut into tiles of BLOCK_N, and where that gives too few programs
     to fill the GPU (an o or down projection has 1,024 outputs: 32 tiles for 132 SMs) the inner dimension is cut into
     SPLIT_K parts too (split-K), until about PROGRAMS_PER_SM programs per SM (`plan`). Each program streams its
     [BLOCK_N, in / SPLIT_K] slice of W in [BLOCK_N, BLOCK_K] tiles, which Triton's software pipeline loads ahead of
     use, and multiplies them by the few rows of x (padded to a tile of MAX_ROWS rows: the tensor cores are idle
     anyway);
  2. no second kernel for split-K: each program writes its fp32 partial sums to a workspace and adds one to its tile's
     counter; the program that arrives last (the counter's old value is SPLIT_K - 1) sums the SPLIT_K partials in
     split order, adds the bias, writes y and sets the counter back to 0 for the next launch. The sum's order never
     depends on which program came last, so the result is deterministic. The counter's atomic add is acquire-release
     at GPU scope, after a barrier (all of the program's threads have stored): the partials a program stored before
     its add are visible to the program that reads them after its own. The reads bypass L1 too (`.cg`), which the
     acquire makes unnecessary: a second guard, kept;
  3. SiLU-and-mul rides in the down projection's input load: its x is gate|up's whole output [gate | up], and the
     kernel forms silu(gate) * up as it loads a tile, rounded as the SiLU kernel rounds (SILU_INPUT);
  4. no gap between one kernel and the next (sm_90 and later): the kernel is launched as a programmatic dependent of
     the kernel before it (CUDA's programmatic dependent launch, PDL). Each program first lets the next kernel start
     (griddepcontrol.launch_dependents), so that kernel's programs are placed on the SMs while this one still runs;
     there they ask L2 for the first PREFETCH_LINES 128-byte lines of each of their weight rows (the one input no
     earlier kernel writes) and then wait (griddepcontrol.wait) until the kernel before has finished and its writes
     are visible. Nothing is read or written before that wait but the prefetch. What it saves at each projection that
     follows another: the launch gap, and the first DRAM round trip (the pipeline's first tiles come from L2).

Why not a better cuBLAS configuration: cuBLASLt takes a split-K factor and a reduction scheme only through its C API's
algorithm preferences, which torch does not expose to Python (nanoserve ships no compiled code); and a library call
can neither take SiLU-and-mul into its load (3) nor promise a fixed order of its split sums."""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nanoserve.layer_ops import silu_and_mul_ref
from nanoserve.layers import MergedLinear
from nanoserve.triton_shim import tl, triton

MAX_ROWS = 16  # rows that take the GEMV: the smallest tile tl.dot takes, and where cuBLAS's GEMMs stop being GEMVs
BLOCK_N = 32  # output features per program
BLOCK_K = 128  # inner elements per loaded tile: a [32, 128] bf16 tile is 8 KiB, 64 bytes per thread of 4 warps
PROGRAMS_PER_SM = 2  # split-K until the grid has about this many programs per SM
MIN_SPLIT_TILES = 2  # ... while each split still streams at least this many tiles
NUM_WARPS = 4
NUM_STAGES = 3  # weight tiles in flight in the software pipeline
DEPENDENT_LAUNCH = True  # 4. above, where the GPU has it (False: every launch a plain one; bench.py's third run)
PREFETCH_LINES = 4  # 128-byte lines of each weight row that a waiting program asks L2 for (bf16: 2 tiles of BLOCK_K)


def plan(out_features: int, in_features: int, num_sms: int) -> int:
    """SPLIT_K for a projection of this shape on num_sms SMs: the inner dimension split in two until the grid has
    PROGRAMS_PER_SM programs per SM, or until a split would stream fewer than MIN_SPLIT_TILES tiles."""
    tiles = triton.cdiv(out_features, BLOCK_N)
    split_k = 1
    while tiles * split_k < PROGRAMS_PER_SM * num_sms and in_features >= 2 * split_k * MIN_SPLIT_TILES * BLOCK_K:
        split_k *= 2
    return split_k


def dependent_launch(device: torch.device) -> bool:
    """Whether kernels launch as programmatic dependents on this device: CUDA's sm_90 (Hopper) and later."""
    on_nvidia = device.type == "cuda" and torch.version.hip is None  # (ROCm's MI300 reports capability 9.4)
    return DEPENDENT_LAUNCH and on_nvidia and torch.cuda.get_device_capability(device)[0] >= 9


class Workspace:
    """What every wrapped projection's GEMV shares (kernels on one stream never overlap): the split-K partial sums,
    [SPLIT_K, MAX_ROWS, out] fp32 as one flat buffer, and the arrival counters (int32, one per output tile, zero
    between launches), each as large as the largest projection needs (`reserve`); and whether launches are
    programmatic dependents, chosen once."""

    def __init__(self, device: torch.device) -> None:
        self.partials = torch.empty(0, dtype=torch.float32, device=device)
        self.counters = torch.zeros(0, dtype=torch.int32, device=device)
        self.dependent_launch = dependent_launch(device)

    def reserve(self, out_features: int, split_k: int) -> None:
        """Room for a projection of out_features outputs split split_k ways (when the engine starts, before graphs)."""
        tiles = triton.cdiv(out_features, BLOCK_N)
        if split_k > 1 and len(self.partials) < split_k * MAX_ROWS * out_features:
            self.partials = self.partials.new_empty(split_k * MAX_ROWS * out_features)
        if split_k > 1 and len(self.counters) < tiles:
            self.counters = self.counters.new_zeros(tiles)


class FewRowLinear(nn.Module):
    """A projection whose forward reads its weight with the GEMV for at most MAX_ROWS rows, and with the base
    projection's own forward otherwise. The base keeps its parameters (and their names' place in the checkpoint).
    silu_and_mul: for a down projection whose input is [gate | up] (the kernel table's SiLU-and-mul moved here), the
    function that makes its real input for more rows; None for any other."""

    def __init__(
        self, base: nn.Linear, workspace: Workspace, num_sms: int, use_kernel: bool, silu_and_mul: Callable | None
    ) -> None:
        super().__init__()
        self.base = base
        self.workspace = workspace
        self.split_k = plan(base.out_features, base.in_features, num_sms)
        workspace.reserve(base.out_features, self.split_k)
        self.gemv = gemv if use_kernel else gemv_ref
        self.silu_and_mul = silu_and_mul
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

    def forward(self, x: Tensor) -> Tensor:
        silu_input = self.silu_and_mul is not None
        if len(x) <= MAX_ROWS:
            return self.gemv(x, self.base.weight, self.base.bias, self.split_k, self.workspace, silu_input)
        if silu_input:
            x = self.silu_and_mul(x)
        return self.base(x)


def warm_up(projections: list[FewRowLinear]) -> None:
    """Every build the GEMV needs, compiled now rather than in a step (the LM head runs outside the decode graphs, whose
    capture compiles the others): Triton builds apart for 1 row, for 16 (a multiple of 16) and for any other count."""
    for projection in projections:
        columns = projection.in_features
        if projection.silu_and_mul is not None:
            columns *= 2  # [gate | up]
        for rows in (1, 2, MAX_ROWS):
            projection(projection.weight.new_zeros(rows, columns))


def gemv_ref(
    x: Tensor, weight: Tensor, bias: Tensor | None, split_k: int, workspace: Workspace, silu_input: bool = False
) -> Tensor:
    """The kernel's PyTorch reference: torch's own x @ weight^T (+ bias), in x's dtype (split_k and the workspace only
    shape the kernel's work, never its result); with silu_input, x is [gate | up] and the input is SiLU-and-mul of it.
    No fp32 copy of the weight: the LM head's would be 0.6 GB."""
    if silu_input:
        x = silu_and_mul_ref(x)
    return F.linear(x, weight, bias)


def gemv(
    x: Tensor, weight: Tensor, bias: Tensor | None, split_k: int, workspace: Workspace, silu_input: bool = False
) -> Tensor:
    """x [rows <= MAX_ROWS, in] @ weight [out, in]^T (+ bias [out]) -> [rows, out] in x's dtype, by _gemv_kernel; with
    silu_input, x is [rows, 2 in] = [gate | up] and the input is silu(gate) * up, made as the kernel loads it."""
    rows = len(x)
    out_features, in_features = weight.shape
    assert rows <= MAX_ROWS and x.stride(1) == 1 and weight.stride(1) == 1, "rows over MAX_ROWS, or strided rows"
    columns = 2 * in_features if silu_input else in_features
    assert x.shape[1] == columns, "x's columns: in, or gate and up"
    y = x.new_empty(rows, out_features)
    # each split's share of the inner dimension, in whole tiles, so the splits never overlap
    k_per_split = triton.cdiv(triton.cdiv(in_features, split_k), BLOCK_K) * BLOCK_K
    dependent = workspace.dependent_launch
    _gemv_kernel[triton.cdiv(out_features, BLOCK_N), split_k](
        x,
        weight,
        bias if bias is not None else weight,  # (never read without a bias)
        y,
        workspace.partials,
        workspace.counters,
        rows,
        out_features,
        in_features,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        SILU_INPUT=silu_input,
        SPLIT_K=split_k,
        K_PER_SPLIT=k_per_split,
        BLOCK_M=MAX_ROWS,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        DEPENDENT=dependent,
        PREFETCH_LINES=PREFETCH_LINES,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
        launch_pdl=dependent,
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
    rows,
    N,
    K,
    stride_x,
    stride_w,
    stride_y,
    HAS_BIAS: tl.constexpr,
    SILU_INPUT: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DEPENDENT: tl.constexpr,
    PREFETCH_LINES: tl.constexpr,
):
    # program (tile, split): output features [tile * BLOCK_N, +BLOCK_N) over inner elements [split * K_PER_SPLIT,
    # +K_PER_SPLIT); the last of a tile's SPLIT_K programs to finish writes the tile's output
    tile = tl.program_id(0)
    split = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of x, padded
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_w  # [BLOCK_N, 1]: 64-bit, a weight may pass 2^31 elements
    if DEPENDENT:  # launched as a programmatic dependent (4. in the module's docstring)
        tl.extra.cuda.gdc_launch_dependents()
        line = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth  # elements per 128-byte line (1,024 bits)
        lines = split * K_PER_SPLIT + tl.arange(0, PREFETCH_LINES) * line  # [PREFETCH_LINES] first elements
        row_at = tl.minimum(n, N - 1)[:, None].to(tl.int64) * stride_w  # [BLOCK_N, 1] (all in the weight)
        _prefetch_into_l2(w_ptr + row_at + tl.minimum(lines, K - 1)[None, :])
        tl.extra.cuda.gdc_wait()  # the kernel before has finished: x, the workspace and y are safe to touch
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(split * K_PER_SPLIT, (split + 1) * K_PER_SPLIT, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x_at = x_ptr + m[:, None] * stride_x + k[None, :]
        x_mask = (m[:, None] < rows) & (k[None, :] < K)
        x = tl.load(x_at, mask=x_mask, other=0.0)  # [BLOCK_M, BLOCK_K]
        if SILU_INPUT:  # x's rows are [gate | up]: this is gate; silu(gate) * up, rounded as the SiLU kernel rounds
            g = x.to(tl.float32)
            silu = (g / (1.0 + tl.exp(-g))).to(x.dtype)
            x = silu * tl.load(x_at + K, mask=x_mask, other=0.0)
        w_mask = (n[:, None] < N) & (k[None, :] < K)
        w = tl.load(w_rows + k[None, :], mask=w_mask, other=0.0)  # [BLOCK_N, BLOCK_K]
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")  # (fp32 weights: no TF32 rounding)
    out_mask = (m[:, None] < rows) & (n[None, :] < N)
    tile_at = m[:, None] * N + n[None, :]  # [BLOCK_M, BLOCK_N]: the tile's place in one split's partial sums
    if SPLIT_K == 1:
        _write_rows(acc, bias_ptr, y_ptr, stride_y, m, n, N, out_mask, HAS_BIAS)
    else:
        # this split's partial sums, then its arrival on the tile's counter (2. in the module's docstring)
        tl.store(partials_ptr + split * BLOCK_M * N + tile_at, acc, mask=out_mask)
        tl.debug_barrier()  # every thread of the program has stored before the counter says so
        if tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:  # the tile's last
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT_K):  # in split order, whichever program came last
                part = partials_ptr + s * BLOCK_M * N + tile_at
                total += tl.load(part, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(counters_ptr + tile, 0)  # ready for the next launch (a graph replays this one)
            _write_rows(total, bias_ptr, y_ptr, stride_y, m, n, N, out_mask, HAS_BIAS)


@triton.jit
def _prefetch_into_l2(pointers):
    """Ask L2 for the 128-byte line at each pointer (a hint: nothing waits for it, nothing is returned)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [pointers], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _write_rows(acc, bias_ptr, y_ptr, stride_y, m, n, N, out_mask, HAS_BIAS: tl.constexpr):
    """A tile's sums, plus the bias, into y in y's dtype."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + n, mask=n < N, other=0.0)  # [BLOCK_N]
        acc += bias.to(tl.float32)[None, :]
    y_at = y_ptr + m[:, None] * stride_y + n[None, :]
    tl.store(y_at, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
