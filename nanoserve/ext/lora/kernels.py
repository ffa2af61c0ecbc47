"""Punica's LoRA kernel (SGMV: "Punica: Multi-Tenant LoRA Serving", Chen et al., 2023), which gives each row of a batch
its own adapter's update of one projection, y += scale x (x @ A^T) @ B^T, as two thin matmuls by one kernel: shrink,
x [rows, in] @ A[slot]^T -> u [rows, rank], then expand, u @ B[slot]^T added into y [rows, out].

A step's rows are grouped by adapter slot into segments, which the step's inputs carry: `rows_by_slot` lists the rows
of slot 0, then those of slot 1, ..., and slot s's are rows_by_slot[slot_starts[s] : slot_starts[s + 1]]. So a program
reads one slot's weight tile once for up to TILE_M rows of that slot, as a plain matmul reads a weight tile once per
row tile; a row of no adapter is in no segment, and no program touches it. `ranks[s]` is the rank slot s's adapter has
in this projection, 0 where it leaves the projection alone: those programs return at once.

A merged projection (q|k|v, gate|up) has an A and a B per shard (q, k, v), stacked: shrink makes every shard's u in one
pass (A: [slots, shards x max rank, in]), and expand's third grid axis is the shard, which reads its own columns of u
and writes its own columns of y, so each adapted projection launches the kernel twice whatever its shards.

The grid depends on the number of rows alone, never on how they are split among slots (a program past its slot's
segment returns at once), so a CUDA graph captured once replays for any mix of adapters: the segments are inputs, read
from the same buffers by every replay. The kernel is followed by its launcher (shapes and dtypes asserted, the grid),
then its PyTorch reference, which loops over the segments on the host."""

from itertools import pairwise

import torch
from torch import Tensor

from nanoserve.triton_shim import tl, triton

TILE_M = 16  # rows of one slot per program: the smallest tile tl.dot takes (a decode step has a few rows per slot)
TILE_N = 64  # output columns per program
MAX_TILE_K = 64  # reduced columns per loop: the input features (shrink), the ranks (expand: at least 16, tl.dot's)


@triton.jit
def _sgmv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    rows_ptr,
    slot_starts_ptr,
    ranks_ptr,
    scales_ptr,
    col_starts_ptr,
    num_rows,
    num_cols,
    k_size,
    stride_xm,
    stride_wl,
    stride_wn,
    stride_om,
    TILE_M: tl.constexpr,
    TILE_N: tl.constexpr,
    TILE_K: tl.constexpr,
    EXPAND: tl.constexpr,
):
    # program (slot x row tile, column tile, shard): out[rows, cols] = x[rows, the shard's k_size columns] @
    # w[slot][cols]^T for up to TILE_M rows of the slot's segment. Shrink: one shard, all num_cols columns of out.
    # Expand: shard s owns out's columns [col_starts[s], col_starts[s + 1]) and x's [s x k_size, (s + 1) x k_size),
    # and the product is scaled by the slot's scale and added to out
    tiles_per_slot = tl.cdiv(num_rows, TILE_M)
    slot = tl.program_id(0) // tiles_per_slot
    start = tl.load(slot_starts_ptr + slot) + (tl.program_id(0) % tiles_per_slot) * TILE_M
    end = tl.load(slot_starts_ptr + slot + 1)
    shard = tl.program_id(2)
    col_start = 0
    col_end = num_cols
    if EXPAND:
        col_start = tl.load(col_starts_ptr + shard)
        col_end = tl.load(col_starts_ptr + shard + 1)
    col_start += tl.program_id(1) * TILE_N
    if start >= end or col_start >= col_end or tl.load(ranks_ptr + slot) == 0:
        return  # past the slot's segment or the shard's columns, or the adapter leaves this projection alone
    m = start + tl.arange(0, TILE_M)
    in_segment = m < end
    rows = tl.load(rows_ptr + m, mask=in_segment, other=0).to(tl.int64)  # [TILE_M] rows of x and out
    n = col_start + tl.arange(0, TILE_N)
    k = tl.arange(0, TILE_K)
    acc = tl.zeros((TILE_M, TILE_N), dtype=tl.float32)
    for k0 in range(0, k_size, TILE_K):
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + shard * k_size + (k0 + k)[None, :],
            mask=in_segment[:, None] & (k0 + k < k_size)[None, :],
            other=0.0,
        )  # [TILE_M, TILE_K]
        w = tl.load(
            w_ptr + slot * stride_wl + n[None, :] * stride_wn + (k0 + k)[:, None],
            mask=(n < col_end)[None, :] & (k0 + k < k_size)[:, None],
            other=0.0,
        )  # [TILE_K, TILE_N]: w[slot]^T's tile
        # expand's x is shrink's fp32 output, rounded to the weights' dtype (16-bit models: their tensor cores), as
        # vLLM's kernels do; "ieee": an fp32 model's products are not rounded to TF32
        acc += tl.dot(x.to(w.dtype), w, input_precision="ieee")
    mask = in_segment[:, None] & (n < col_end)[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_om + n[None, :]
    if EXPAND:
        acc = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32) + acc * tl.load(scales_ptr + slot)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sgmv(
    out: Tensor,
    x: Tensor,
    w: Tensor,
    rows_by_slot: Tensor,
    slot_starts: Tensor,
    ranks: Tensor,
    scales: Tensor | None = None,
    col_starts: Tensor | None = None,
) -> None:
    """Shrink (without scales and col_starts): out [rows, N] fp32 = x [rows, in] @ w[slot]^T, w
    [slots, N, in] each slot's A (N = shards x max rank, the shards' As stacked). Expand: in place on out [rows, M],
    the base projection's output, out[row, shard i's columns] += scales[slot] x x[row, shard i's ranks] @ w[slot, shard
    i's columns]^T, x the shrink's out and w [slots, M, max rank] each slot's B; scales [slots] fp32; col_starts
    [shards + 1] int32 on the device, the column where each shard starts (and the end). Either for each row of each
    slot's segment whose rank is not 0: other rows are left as they are (a shrink's, unset: expand never reads them)."""
    num_slots, num_cols, k_size = w.shape
    shards = 1 if col_starts is None else len(col_starts) - 1
    assert x.stride(1) == out.stride(1) == 1 and w.is_contiguous() and rows_by_slot.dtype == torch.int32
    assert (
        x.shape == (len(out), shards * k_size) and out.shape[1] == num_cols and (scales is None) == (col_starts is None)
    )
    assert slot_starts.shape == (num_slots + 1,) and ranks.shape == (num_slots,) and ranks.dtype == torch.int32
    # a shard's column tiles past its own columns return at once (expand: columns of the widest shard would do)
    grid = (num_slots * triton.cdiv(len(x), TILE_M), triton.cdiv(num_cols, TILE_N), shards)
    _sgmv_kernel[grid](
        x,
        w,
        out,
        rows_by_slot,
        slot_starts,
        ranks,
        scales,
        col_starts,
        len(x),
        num_cols,
        k_size,
        x.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        TILE_M=TILE_M,
        TILE_N=TILE_N,
        TILE_K=min(MAX_TILE_K, max(16, triton.next_power_of_2(k_size))),
        EXPAND=col_starts is not None,
    )


def sgmv_ref(
    out: Tensor,
    x: Tensor,
    w: Tensor,
    rows_by_slot: Tensor,
    slot_starts: Tensor,
    ranks: Tensor,
    scales: Tensor | None = None,
    col_starts: Tensor | None = None,
) -> None:
    k_size = w.shape[2]
    columns = list(pairwise(col_starts.tolist())) if col_starts is not None else [(0, w.shape[1])]
    rank_of = ranks.tolist()  # the segments, read on the host (a sync on a GPU)
    for slot, (first, last) in enumerate(pairwise(slot_starts.tolist())):
        if first == last or not rank_of[slot]:
            continue
        rows = rows_by_slot[first:last].long()
        x_rows = x.index_select(0, rows).to(w.dtype).float()  # gathered once; an expand's u rounded as the kernel does
        product = torch.cat(  # each shard's columns (a shrink has one)
            [
                x_rows[:, i * k_size : (i + 1) * k_size] @ w[slot, start:end].float().T
                for i, (start, end) in enumerate(columns)
            ],
            dim=1,
        )
        if scales is not None:  # expand: scaled, added to the base output
            product = out.index_select(0, rows).float() + product * scales[slot]
        out.index_copy_(0, rows, product.to(out.dtype))  # (out[rows] = ...: 100x slower for a few rows on a CPU)
