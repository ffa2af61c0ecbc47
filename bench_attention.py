"""Benchmark nanoserve's paged attention kernels against PyTorch SDPA on the same data, laid out contiguously.

Decode is memory-bound, so its figure is achieved bandwidth: K and V bytes read per second. Prefill is
compute-bound, so its figure is TFLOP/s over the causal half of QK^T and PV. Heads are Qwen3-0.6B's (16 query,
8 KV, head_dim 128) in bf16; our K/V sit in shuffled cache blocks, SDPA's in [batch, kv_heads, len, head_dim].
Needs CUDA. Usage: python bench_attention.py [--block-size 16]
"""

import argparse
import importlib.util
import json

import torch
import torch.nn.functional as F
from triton import cdiv
from triton.testing import do_bench

from nanoserve.attention import PAD_SLOT, AttentionMetadata, decode_splits, num_sms, paged_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128  # Qwen3-0.6B
DTYPE = torch.bfloat16
DECODE_CASES = [(b, ctx) for b in (64, 128, 256) for ctx in (1024, 4096, 8192)] + [
    (b, ctx) for b in (1, 8) for ctx in (8192, 32768)
]  # (batch, context): big batches, then small and long
PREFILL_CASE = (8, 2048)  # (sequences, tokens each), causal, nothing cached
# decode behind a shared prompt, as bench.py --prefix: (batch, shared tokens, each sequence's own tokens after them);
# plain paged attention beside cascade attention (ext/cascade.py) and SDPA, in logical TB/s (every sequence's keys)
CASCADE_CASES = [(256, 2048, 128), (64, 2048, 128), (16, 4096, 256)]
# ext/latency's decode (the last split merges; a dependent launch on sm_90) gets a row of kind "decode, latency kernels"
# beside each decode case that the core splits, where the extension is installed
COPIES_IN_MEMORY = 6  # K and V, each contiguous + paged + a transient copy while paging: skip what won't fit
# the fused QK-norm + RoPE + K/V store (ext/fused_kernels.py: qk_norm_rope_store_kv) at a decode step's tokens: 1
# (one request) and 256 (the standard workload's batch), beside its PyTorch reference (separate torch kernels)
FUSED_TOKENS = (1, 256)


def make_case(batch, ctx, query_len, block_size):
    """Random q, K, V; K/V both contiguous (for SDPA) and paged in shuffled blocks (for us). Queries are last tokens."""
    blocks_per_seq = cdiv(ctx, block_size)
    k = torch.randn(batch, NUM_KV_HEADS, ctx, HEAD_DIM, device="cuda", dtype=DTYPE)  # [B, kv_heads, ctx, D]
    v = torch.randn_like(k)
    block_tables = torch.randperm(batch * blocks_per_seq, dtype=torch.int32, device="cuda").view(batch, -1)

    def paged(x):  # [B, kv_heads, ctx, D] -> [num_blocks, block_size, kv_heads, D], placed by the block table
        x = F.pad(x, (0, 0, 0, blocks_per_seq * block_size - ctx)).transpose(1, 2)  # [B, padded ctx, kv_heads, D]
        cache = torch.empty(batch * blocks_per_seq, block_size, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        cache[block_tables.flatten().long()] = x.reshape(-1, block_size, NUM_KV_HEADS, HEAD_DIM)
        return cache

    q = torch.randn(batch, NUM_HEADS, query_len, HEAD_DIM, device="cuda", dtype=DTYPE)  # [B, heads, q_len, D]
    meta = AttentionMetadata(
        slot_mapping=torch.full((batch * query_len,), PAD_SLOT, dtype=torch.int32, device="cuda"),  # no store here
        query_start_loc=torch.arange(0, batch * query_len + 1, query_len, dtype=torch.int32, device="cuda"),
        context_lens=torch.full((batch,), ctx, dtype=torch.int32, device="cuda"),
        block_tables=block_tables,
        max_query_len=query_len,
        decode_only=query_len == 1,
    )
    return q, k, v, paged(k), paged(v), meta


def replayed(fn) -> tuple:
    """(a function, how it is timed): fn captured once in a CUDA graph and the graph's replay, "graph"; or fn itself,
    "eager", where the capture fails (said on stdout: GPU minutes are few, and a row timed eagerly beats a stage lost).
    A replay is the GPU's time for fn without the host's (one launch call however many kernels fn runs), as the engine
    runs its decode steps. A decode kernel of a few microseconds is launched by Python work that may take longer than
    the kernel; timed eagerly, the GPU may wait for the host inside the timed window. (The first H100 run's batch-1
    decode rows took ~50 us at 2k and at 8k keys alike, where the engine's profile had 7 us per layer at 512: the host,
    most likely, though do_bench's L2 flush before each call gives the host a head start, so part may be the GPU's;
    the graph rows beside the eager ones tell.) Prefill and cascade steps run eagerly in the engine: timed eagerly."""
    fn()  # compiles
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # a warm-up on a side stream, as torch asks before a capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as error:
        torch.cuda.set_stream(stream)  # (a capture that fails to end may leave its own stream current)
        print(f"CUDA-graph capture failed, timed eagerly instead: {str(error)[:200]}", flush=True)
        return fn, "eager"
    return graph.replay, "graph"


def bench_case(batch, ctx, query_len, block_size, attend=paged_attention) -> dict:
    """Our time and SDPA's for one batch (both see the same numbers), their max |difference|, and for decode both
    eager times beside: decode is timed as CUDA-graph replays (`replayed`), prefill eagerly. attend: our paged
    attention (the core's, or ext/latency's decode)."""
    q, k, v, k_cache, v_cache, meta = make_case(batch, ctx, query_len, block_size)
    scale = HEAD_DIM**-0.5
    q_rows = q.transpose(1, 2).reshape(-1, NUM_HEADS, HEAD_DIM)  # [B * q_len, heads, D]: a sequence's rows together

    def ours():
        return attend(q_rows, k_cache, v_cache, meta, scale)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=query_len > 1, scale=scale, enable_gqa=True)

    diff = (ours().view(batch, query_len, NUM_HEADS, HEAD_DIM).transpose(1, 2) - sdpa()).abs().max().item()
    eager = {"ours_eager_ms": do_bench(ours), "sdpa_eager_ms": do_bench(sdpa)}  # (do_bench flushes L2 before each)
    if query_len > 1:
        return {"ours_ms": eager["ours_eager_ms"], "sdpa_ms": eager["sdpa_eager_ms"], "timing": "eager", "diff": diff}
    (ours_replay, ours_timing), (sdpa_replay, sdpa_timing) = replayed(ours), replayed(sdpa)
    timing = "graph" if ours_timing == sdpa_timing == "graph" else f"ours {ours_timing}, sdpa {sdpa_timing}"
    return {"ours_ms": do_bench(ours_replay), "sdpa_ms": do_bench(sdpa_replay), "timing": timing, "diff": diff} | eager


def bench_cascade_case(batch, shared, own, block_size):
    """(cascade ms, plain ms, SDPA ms, max |cascade - SDPA|) for a decode batch whose first `shared` keys are the same
    blocks for every sequence, as the prefix cache makes them."""
    from nanoserve.ext import cascade

    q, k, v, k_cache, v_cache, meta = make_case(batch, shared + own, 1, block_size)
    shared_blocks = shared // block_size
    meta.block_tables[1:, :shared_blocks] = meta.block_tables[0, :shared_blocks]  # the same blocks...
    k[1:, :, :shared], v[1:, :, :shared] = k[:1, :, :shared], v[:1, :, :shared]  # ...and SDPA's the same keys
    scale = HEAD_DIM**-0.5
    q_rows = q.transpose(1, 2).reshape(-1, NUM_HEADS, HEAD_DIM)
    suffix = cascade.suffix_metadata(meta, shared_blocks, block_size)

    def cascaded():
        return cascade.cascade_attention(q_rows, k_cache, v_cache, meta, suffix, shared_blocks, scale)

    def plain():
        return paged_attention(q_rows, k_cache, v_cache, meta, scale)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    diff = (cascaded().view(batch, 1, NUM_HEADS, HEAD_DIM).transpose(1, 2) - sdpa()).abs().max().item()
    return do_bench(cascaded), do_bench(plain), do_bench(sdpa), diff


def run_cascade_rows(print_fn, block_size, kv_bytes_per_token) -> list[dict]:
    """The cascade cases' rows: logical TB/s (every sequence's keys counted, as plain attention reads them)."""
    rows = []
    for batch, shared, own in CASCADE_CASES:
        cascade_ms, plain_ms, sdpa_ms, diff = bench_cascade_case(batch, shared, own, block_size)
        work = batch * (shared + own) * kv_bytes_per_token / 1e12
        row = {"kind": "cascade", "batch": batch, "context": shared + own, "shared": shared, "block_size": block_size}
        row |= {"unit": "TB/s", "ours": round(work / (cascade_ms / 1e3), 3), "sdpa": round(work / (sdpa_ms / 1e3), 3)}
        row |= {"ratio": round(sdpa_ms / cascade_ms, 3), "plain_over_cascade": round(plain_ms / cascade_ms, 2)}
        row |= {"ours_ms": round(cascade_ms, 4), "plain_ms": round(plain_ms, 4), "sdpa_ms": round(sdpa_ms, 4)}
        rows.append(row | {"max_abs_diff": diff})
        name = f"cascade B={batch} {shared}+{own}"
        print_fn(f"{name:<24}{row['ours']:>10.2f}{row['sdpa']:>10.2f}  TB/s    {row['ratio']:>10.2f}{diff:>11.2e}")
        print_fn(f"{'':<24}plain paged attention {plain_ms:.3f} ms: {row['plain_over_cascade']}x the cascade's time")
        torch.cuda.empty_cache()
    return rows


def bench_fused_case(num_tokens: int, block_size: int, timer=None, device: str = "cuda", dtype=DTYPE) -> dict:
    """The fused rotation + K/V store on num_tokens decode tokens (Qwen3's heads, QK norm on, each token in its own
    slot of a 4k-token cache): its time beside its PyTorch reference's on the same inputs, and whether the two wrote
    the same cache and q. timer: fn -> ms (do_bench on a GPU). (On a CPU, tests run it in fp32: Triton's interpreter
    multiplies bf16 numbers wrongly.)"""
    from nanoserve.ext.fused_kernels import qk_norm_rope_store_kv
    from nanoserve.layer_ops import qk_norm_rope_store_kv_ref

    timer = timer or do_bench
    on = {"device": device, "dtype": dtype}
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, **on)
    k, v = (torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, **on) for _ in range(2))
    positions = torch.randint(0, 4096, (num_tokens,), device=device, dtype=torch.int32)
    freqs = torch.outer(torch.arange(4096, device=device).float(), torch.rand(HEAD_DIM // 2, device=device))
    slots = torch.randperm(4096, device=device)[:num_tokens].int()
    weights = (torch.rand(HEAD_DIM, **on) + 0.5, torch.rand(HEAD_DIM, **on) + 0.5, 1e-6)
    caches = [torch.zeros(4096 // block_size, block_size, NUM_KV_HEADS, HEAD_DIM, **on) for _ in range(4)]

    def call(fn, k_cache, v_cache):  # on copies: the kernel rotates q and k in place
        return lambda: fn(
            q.clone(), k.clone(), v, positions, freqs.cos(), freqs.sin(), k_cache, v_cache, slots, *weights
        )

    fused, reference = call(qk_norm_rope_store_kv, *caches[:2]), call(qk_norm_rope_store_kv_ref, *caches[2:])
    same = torch.allclose(fused().float(), reference().float(), atol=0.05) and torch.allclose(
        caches[0].float(), caches[2].float(), atol=0.05
    )
    fused_ms, reference_ms = timer(fused), timer(reference)
    row = {"kind": "rotate+store", "batch": num_tokens, "context": 0, "block_size": block_size, "unit": "us"}
    row |= {"ours": round(fused_ms * 1e3, 2), "reference": round(reference_ms * 1e3, 2)}
    return row | {"ratio": round(reference_ms / fused_ms, 2), "same_as_reference": same}


def attention_row(kind: str, batch: int, ctx: int, block_size: int, case: dict, kv_bytes: int) -> dict:
    """One case's row: our rate and SDPA's (decode: TB/s of K/V read; prefill: TFLOP/s over the causal half), their
    ratio, the times and how they were taken, and the max |difference|."""
    if kind.startswith("decode"):
        unit, work = "TB/s", kv_bytes / 1e12  # each K/V byte read once
    else:
        unit, work = "TFLOP/s", 4 * batch * NUM_HEADS * ctx**2 * HEAD_DIM / 2 / 1e12  # causal: half of 4*L^2*D
    ours, sdpa = work / (case["ours_ms"] / 1e3), work / (case["sdpa_ms"] / 1e3)
    return {
        "kind": kind,
        "batch": batch,
        "context": ctx,
        "block_size": block_size,
        "unit": unit,
        "ours": round(ours, 3),
        "sdpa": round(sdpa, 3),
        "ratio": round(ours / sdpa, 3),
        "ours_ms": round(case["ours_ms"], 4),
        "sdpa_ms": round(case["sdpa_ms"], 4),
        "timing": case["timing"],  # decode: CUDA-graph replays (`replayed`), eager beside; prefill eager
        **{name: round(case[name], 4) for name in ("ours_eager_ms", "sdpa_eager_ms") if name in case},
        "max_abs_diff": case["diff"],
    }


def latency_decode(device: torch.device):
    """ext/latency's paged attention on device (its merged decode, launched as a programmatic dependent where the GPU
    has it), or None where the extension is not installed."""
    if importlib.util.find_spec("nanoserve.ext.latency") is None:
        return None
    from nanoserve.ext.latency import decode, gemv

    return decode.DecodeAttention(device, gemv.dependent_launch(device))


def run_attention_bench(print_fn=print, block_size=16) -> list[dict]:
    """Time every case, print a table and a JSON line, return the rows ([] without CUDA)."""
    if not torch.cuda.is_available():
        print_fn("bench_attention needs CUDA; skipping")
        return []
    kv_bytes_per_token = 2 * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize  # K and V of one token, all KV heads
    cases = [("decode", b, ctx, 1) for b, ctx in DECODE_CASES] + [("prefill", *PREFILL_CASE, PREFILL_CASE[1])]
    rows = []
    latency_attention = latency_decode(torch.device("cuda"))

    def splits(batch: int) -> int:  # the core's split count for a decode batch (its ceiling rule)
        return decode_splits(batch, NUM_KV_HEADS, num_sms(torch.device("cuda")))

    print_fn(
        f"paged attention vs SDPA, {torch.cuda.get_device_name()}, {DTYPE}, heads {NUM_HEADS}/{NUM_KV_HEADS}x"
        f"{HEAD_DIM}, block_size {block_size}"
    )
    print_fn(f"{'case':<24}{'ours':>10}{'sdpa':>10}  {'unit':<8}{'ours/sdpa':>10}{'max|diff|':>11}")
    for kind, batch, ctx, query_len in cases:
        kv_bytes = batch * ctx * kv_bytes_per_token
        if COPIES_IN_MEMORY * kv_bytes > torch.cuda.mem_get_info()[0]:
            print_fn(f"{kind} B={batch} ctx={ctx}: skipped, needs {COPIES_IN_MEMORY * kv_bytes / 2**30:.0f} GiB")
            continue
        timed = [(kind, bench_case(batch, ctx, query_len, block_size))]
        if kind == "decode" and latency_attention is not None and splits(batch) > 1:
            # ext/latency's decode beside the core's where the core splits (the extension's merge, or its one split
            # where the core splits in two), named so
            timed.append(("decode, latency kernels", bench_case(batch, ctx, 1, block_size, latency_attention)))
        for name, case in timed:
            rows.append(attention_row(name, batch, ctx, block_size, case, kv_bytes))
            row = rows[-1]
            shown = f"{name} B={batch} ctx={ctx}"
            print_fn(
                f"{shown:<24}{row['ours']:>10.2f}{row['sdpa']:>10.2f}  {row['unit']:<8}{row['ratio']:>10.2f}"
                f"{row['max_abs_diff']:>11.2e}"
            )
        torch.cuda.empty_cache()
    if importlib.util.find_spec("nanoserve.ext.cascade") is not None:
        rows += run_cascade_rows(print_fn, block_size, kv_bytes_per_token)
    for num_tokens in FUSED_TOKENS:  # the fused rotation + K/V store, beside its reference's separate kernels
        rows.append(bench_fused_case(num_tokens, block_size))
        row = rows[-1]
        name = f"rotate+store T={num_tokens}"
        print_fn(f"{name:<24}{row['ours']:>10.2f}{row['reference']:>10.2f}  us (ref)  {row['ratio']:>10.2f}")
    print_fn(json.dumps({"bench": "attention", "device": torch.cuda.get_device_name(), "results": rows}))
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=16, help="KV cache block size (power of two, 16..256)")
    run_attention_bench(block_size=parser.parse_args().block_size)
