"""Routed experts in one fused Triton kernel (vLLM's fused_moe; MegaBlocks' and SGLang's grouped GEMMs are the same
idea): each token goes through k of E experts' gated MLPs, down(silu(gate(x)) * up(x)), and its output is their sum,
weighted by the router. A step's tokens choose their experts on the device, so no program knows in advance which rows
an expert gets. The kernel's answer:
  1. route: softmax over the router's logits, the top k, renormalised where the family says (route);
  2. group: the step's (token, choice) pairs, num_tokens x k of them, sorted by expert into groups padded to whole
     blocks of BLOCK_M rows, one expert per block (group_by_expert). A block's rows then share one expert's weights,
     which a program reads once per block, as a dense matmul reads a weight tile once per row tile. A decode step's
     few pairs are grouped by one Triton program (one launch where PyTorch's sort takes some twenty small kernels, as
     long as the matmuls of a few tokens); a prefill's many by PyTorch's sort;
  3. multiply: one launch multiplies every block by its expert's gate|up weights and applies SiLU-and-mul, writing each
     pair's row of the intermediate [pairs, moe_intermediate]; a second multiplies those rows by each expert's down
     weights, scaled by the pair's router weight ([pairs, hidden]);
  4. sum: each token's k rows added into its own row.
A decode step of a few tokens reads only the experts its tokens chose, each once, however many tokens chose it: the
bytes of a step are its distinct experts times an expert's bytes, not E times them.

Shapes never depend on the routing, only on num_tokens, k and E: the grid has the most blocks any routing can need,
and the blocks past those in use return at once (their count is read on the device), so a CUDA graph captured once
replays whatever the router picks. Each kernel is followed by its launcher (shapes asserted, the grid); the PyTorch
reference comes last, the plain loop over experts, which finds each expert's rows on the host."""

import torch
import torch.nn.functional as F
from torch import Tensor

from nanoserve.layer_ops import silu_and_mul_ref
from nanoserve.triton_shim import tl, triton

# Tiles, by the model dtype's element size: 16-bit dots run on the tensor cores; fp32 ones (IEEE, not TF32) on the FMA
# units, which hold their operand tiles in registers, so fp32 tiles are smaller (no spills on sm_90: see the tests)
MIN_BLOCK_M = 16  # rows per block: tl.dot's least, enough for a decode step's few tokens per expert
MAX_BLOCK_M = {2: 64, 4: 32}  # ... up to a prefill's full tensor-core tile (wgmma at 64 rows)
BLOCK_N = 64  # output features per program
BLOCK_K = {2: 64, 4: 32}  # input features per step of the loop
# steps of up to this many pairs (a decode of 32 tokens x 8 experts: a few steps of the program's loops) are grouped by
# the one-program kernel; larger ones by PyTorch's sort, whose kernels are few next to their matmuls (a prediction for
# the H100: bench_kernels.py moe times both)
MAX_KERNEL_PAIRS = 256
GROUP_TILE_ELEMENTS = 4096  # the one-program grouping's [pairs, experts] tile: pairs per step = this / padded experts
Groups = tuple[Tensor, Tensor, Tensor]  # a step's pairs grouped by expert: sorted_pairs, block_experts, num_blocks


def route(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """router_logits [num_tokens, num_experts] -> (weights [num_tokens, top_k] fp32, experts [num_tokens, top_k]):
    softmax over every expert in fp32, the top k, and with renormalize those k weights rescaled to sum to 1. Qwen3-MoE
    and Mixtral route so (Mixtral always renormalises; Qwen3-MoE where its config's norm_topk_prob says)."""
    probs = router_logits.float().softmax(-1)  # [num_tokens, num_experts]
    weights, experts = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, experts


def block_rows(num_pairs: int, num_experts: int, dtype: torch.dtype) -> int:
    """BLOCK_M for a step: an expert's average number of pairs, as a power of two within MIN_BLOCK_M and MAX_BLOCK_M,
    so a decode step pads little and a prefill fills the tensor cores. From the shapes alone (graph-safe)."""
    average = triton.cdiv(num_pairs, num_experts)
    return min(MAX_BLOCK_M[dtype.itemsize], max(MIN_BLOCK_M, triton.next_power_of_2(average)))


def padding_rows(num_pairs: int, num_experts: int, block_m: int, device: torch.device) -> Tensor:
    """sorted_pairs before any pair has its row: [max_blocks x block_m] of num_pairs (no pair). max_blocks bounds any
    routing's need: an expert with c pairs fills ceil(c / block_m) <= c // block_m + 1 blocks, and at most
    min(E, pairs) experts have any."""
    max_blocks = num_pairs // block_m + min(num_experts, num_pairs)
    return torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)


def group_by_expert(experts: Tensor, num_experts: int, block_m: int) -> Groups:
    """experts [num_tokens, k] -> the pairs sorted by expert into blocks of block_m rows:
      - sorted_pairs [max_blocks x block_m] int32: pair p (token p // k's choice p % k) in its expert's group, each
        group padded to whole blocks with num_pairs (no pair; padding_rows);
      - block_experts [max_blocks]: each block's expert (num_experts for the blocks past those in use);
      - num_blocks [1]: the blocks in use.
    Every shape here comes from num_tokens, k and E, never from the routing itself, and nothing is read on the host
    (a CUDA graph may capture it)."""
    pair_experts = experts.flatten()  # [num_pairs]: each pair's expert
    num_pairs = len(pair_experts)
    device = experts.device
    sorted_pairs = padding_rows(num_pairs, num_experts, block_m, device)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, pair_experts, torch.ones_like(pair_experts))  # [E]: pairs per expert
    blocks = (counts + block_m - 1) // block_m  # [E]: each expert's blocks
    block_ends = blocks.cumsum(0)  # [E]: expert e's blocks end where expert e + 1's begin
    order = pair_experts.argsort(stable=True)  # [num_pairs]: pair ids, by expert
    by_expert = pair_experts[order]
    # a pair's place: its expert's first padded row, plus how many of that expert's pairs come before it
    first_of_expert = counts.cumsum(0) - counts  # [E]: where each expert's pairs start in `order`
    within = torch.arange(num_pairs, device=device) - first_of_expert[by_expert]
    rows = (block_ends - blocks)[by_expert] * block_m + within
    sorted_pairs[rows] = order.int()
    block_ids = torch.arange(len(sorted_pairs) // block_m, device=device)
    block_experts = torch.searchsorted(block_ends, block_ids, right=True).int()  # the first expert ending past it
    return sorted_pairs, block_experts, block_ends[-1:].int()


@triton.jit
def _group_kernel(
    experts_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    num_blocks_ptr,
    num_pairs,
    num_experts,
    max_blocks,
    BLOCK_M: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
    TILE: tl.constexpr,
):
    # one program: group_by_expert's outputs, sorted_pairs already filled with num_pairs (no pair) by the launcher.
    # Pairs are taken TILE at a time as a one-hot [TILE, EXPERTS_PAD] of their experts
    e = tl.arange(0, EXPERTS_PAD)
    is_expert = e < num_experts
    lanes = tl.arange(0, TILE)
    # 1) pairs per expert (a padding lane's expert is EXPERTS_PAD: it matches none)
    counts = tl.zeros((EXPERTS_PAD,), dtype=tl.int32)
    for start in range(0, num_pairs, TILE):
        ids = tl.load(experts_ptr + start + lanes, mask=start + lanes < num_pairs, other=EXPERTS_PAD)
        one_hot = (ids[:, None] == e[None, :]).to(tl.int32)  # [TILE, EXPERTS_PAD]
        counts += tl.sum(one_hot, 0)
    # 2) each expert's blocks, where they end, and the row its first pair takes
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(blocks, 0)
    tl.store(num_blocks_ptr, tl.sum(blocks, 0))
    next_row = (ends - blocks) * BLOCK_M  # [EXPERTS_PAD]: the row each expert's next pair takes
    # 3) each block's expert: the experts whose blocks end at or before it (num_experts past the blocks in use)
    for start in range(0, max_blocks, TILE):
        b = start + lanes
        ended = (ends[None, :] <= b[:, None]) & is_expert[None, :]  # [TILE, EXPERTS_PAD]
        block_expert = tl.sum(ended.to(tl.int32), 1)
        tl.store(block_experts_ptr + b, block_expert, mask=b < max_blocks)
    # 4) each pair's row: its expert's next row, after the tile's earlier pairs of the same expert (pair order kept)
    for start in range(0, num_pairs, TILE):
        pairs = start + lanes
        ids = tl.load(experts_ptr + pairs, mask=pairs < num_pairs, other=EXPERTS_PAD)
        one_hot = (ids[:, None] == e[None, :]).to(tl.int32)  # [TILE, EXPERTS_PAD]
        earlier = tl.cumsum(one_hot, 0) - one_hot  # the same expert's pairs before each, in this tile
        rows = tl.sum(one_hot * (earlier + next_row[None, :]), 1)
        tl.store(sorted_pairs_ptr + rows, pairs, mask=pairs < num_pairs)
        next_row += tl.sum(one_hot, 0)


def group_by_expert_kernel(experts: Tensor, num_experts: int, block_m: int) -> Groups:
    """group_by_expert in one Triton program (the same outputs: equal pairs keep their order): for a decode step."""
    num_pairs = experts.numel()
    device = experts.device
    sorted_pairs = padding_rows(num_pairs, num_experts, block_m, device)
    max_blocks = len(sorted_pairs) // block_m
    block_experts = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_blocks = torch.empty(1, dtype=torch.int32, device=device)
    experts_pad = triton.next_power_of_2(num_experts)
    tile = max(1, GROUP_TILE_ELEMENTS // experts_pad)
    _group_kernel[(1,)](
        experts.contiguous(),
        sorted_pairs,
        block_experts,
        num_blocks,
        num_pairs,
        num_experts,
        max_blocks,
        BLOCK_M=block_m,
        EXPERTS_PAD=experts_pad,
        TILE=tile,
    )
    return sorted_pairs, block_experts, num_blocks


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    pair_weights_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    num_blocks_ptr,
    num_pairs,
    n_size,
    k_size,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    PAIRS_PER_ROW: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # program (m, j): block m of the sorted pairs (BLOCK_M rows, one expert's) times that expert's weights, output
    # features [j x BLOCK_N, (j + 1) x BLOCK_N), into each pair's row of out. Pair p reads row p // PAIRS_PER_ROW of a:
    # the token's hidden state (gate|up: PAIRS_PER_ROW = k) or the pair's own intermediate row (down: 1).
    # GATED (gate|up): w [E, 2 x n_size, k_size] holds gate's rows then up's; out = silu(x @ gate^T) * (x @ up^T).
    # Not GATED (down): out = (h @ down^T) x the pair's router weight.
    m = tl.program_id(0)
    if m >= tl.load(num_blocks_ptr):
        return  # a block no routing of this step needed
    expert = tl.load(block_experts_ptr + m).to(tl.int64)
    pairs = tl.load(sorted_pairs_ptr + m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    is_pair = pairs < num_pairs  # padding rows are loaded as 0 and never stored
    a_rows = (pairs // PAIRS_PER_ROW).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None]  # [BLOCK_K, BLOCK_N]: w^T's tile
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # (gate|up only)
    for k0 in range(0, k_size, BLOCK_K):
        in_k = ks < k_size - k0
        a_mask = is_pair[:, None] & in_k[None, :]
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)  # [BLOCK_M, BLOCK_K]
        w_mask = in_k[:, None] & (cols < n_size)[None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(a, w, input_precision="ieee")  # "ieee": an fp32 model's products are not rounded to TF32
        if GATED:  # up's rows are n_size rows below gate's
            w_up = tl.load(w_ptrs + n_size * stride_wn, mask=w_mask, other=0.0)
            up += tl.dot(a, w_up, input_precision="ieee")
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if GATED:
        acc = acc * tl.sigmoid(acc) * up  # SiLU(gate) * up, in fp32, rounded once below
    else:
        acc *= tl.load(pair_weights_ptr + pairs, mask=is_pair, other=0.0)[:, None]
    out_rows = pairs.to(tl.int64)  # each pair's own row
    out_ptrs = out_ptr + out_rows[:, None] * stride_om + cols[None, :]
    out_mask = is_pair[:, None] & (cols < n_size)[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def moe_gemm(a: Tensor, w: Tensor, out: Tensor, pair_weights: Tensor, groups: Groups, top_k: int, gated: bool) -> None:
    """One launch of the kernel over every block of groups (group_by_expert's): a [rows, K] (tokens, or pairs), w
    [E, N or 2N, K], out [pairs, N]; pair_weights [pairs] fp32, read by the down projection (not gated) only."""
    sorted_pairs, block_experts, num_blocks = groups
    n_size = out.shape[1]
    w_rows = n_size
    pairs_per_row = 1  # down: each pair reads its own row of a, the intermediate
    if gated:  # gate|up: each pair reads its token's row of a, x; w holds gate's rows, then up's
        w_rows = 2 * n_size
        pairs_per_row = top_k
    assert a.stride(1) == w.stride(2) == out.stride(1) == 1
    assert w.shape[1:] == (w_rows, a.shape[1]) and a.dtype == w.dtype == out.dtype
    block_m = len(sorted_pairs) // len(block_experts)
    grid = (len(block_experts), triton.cdiv(n_size, BLOCK_N))
    _moe_gemm_kernel[grid](
        a,
        w,
        out,
        pair_weights,
        sorted_pairs,
        block_experts,
        num_blocks,
        len(out),
        n_size,
        a.shape[1],
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        PAIRS_PER_ROW=pairs_per_row,
        GATED=gated,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K[a.dtype.itemsize],
    )


def fused_moe(x: Tensor, w13: Tensor, w2: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
    """x [num_tokens, hidden] through each token's experts (experts [num_tokens, k], their router weights [num_tokens,
    k] fp32), summed: [num_tokens, hidden]. w13 [E, 2 x inner, hidden]: each expert's gate rows, then its up rows;
    w2 [E, hidden, inner]: its down projection (inner: moe_intermediate_size, or this rank's share of it)."""
    num_tokens, top_k = experts.shape
    num_experts, two_inner, hidden = w13.shape
    assert x.shape == (num_tokens, hidden) and w2.shape == (num_experts, hidden, two_inner // 2)
    block_m = block_rows(experts.numel(), num_experts, x.dtype)
    group = group_by_expert_kernel if experts.numel() <= MAX_KERNEL_PAIRS else group_by_expert
    groups = group(experts, num_experts, block_m)
    pair_weights = weights.flatten()  # [pairs] fp32
    inner = x.new_empty(experts.numel(), two_inner // 2)  # [pairs, inner]: silu(gate) * up, in the model dtype
    moe_gemm(x, w13, inner, pair_weights, groups, top_k, gated=True)
    out = x.new_empty(experts.numel(), hidden)  # [pairs, hidden]: each pair's weighted output
    moe_gemm(inner, w2, out, pair_weights, groups, top_k, gated=False)
    return out.view(num_tokens, top_k, hidden).sum(1)


def fused_moe_ref(x: Tensor, w13: Tensor, w2: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
    """fused_moe in PyTorch, the plain loop over experts: each expert's tokens gathered (found on the host), through
    its gated MLP in the model dtype, weighted, and added into their rows (fp32, rounded once)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(len(w13)):
        tokens, choices = (experts == expert).nonzero(as_tuple=True)  # its pairs: [count] each
        h = silu_and_mul_ref(F.linear(x[tokens], w13[expert]))  # [count, inner]
        y = F.linear(h, w2[expert]).float()  # [count, hidden]
        out.index_add_(0, tokens, y * weights[tokens, choices, None])
    return out.to(x.dtype)
