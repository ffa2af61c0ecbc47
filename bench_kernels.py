"""The GPU measurements that BENCHMARKS.md's predictions name, beyond bench.py's workloads: gpu_check.sh runs them
from this file (Triton refuses a @jit function fed on standard input). Needs CUDA. Each mode writes one file:

    python bench_kernels.py kernels OUT.json [MODEL_DIR]   # kernel timings, one JSON object per measurement
    python bench_kernels.py eager OUT.json MODEL_DIR       # eager steps after warm-up: does a step wait for a compile?
    python bench_kernels.py profile OUT.txt MODEL_DIR      # torch.profiler tables: decode at 256, mixed, decode at 1
    python bench_kernels.py sweep OUT.json                 # attention's tiles, stages and split counts, each timed
    python bench_kernels.py moe OUT.json                   # a Qwen3-30B-A3B routing layer: fused vs its floor

Shapes are Qwen3-0.6B's heads (16 query, 8 KV, head_dim 128) in bf16, block size 16, unless a row says otherwise;
MODEL_DIR is the random Qwen3-0.6B folder gpu_check.sh saves once (`bench.py --save-model`). On a machine without
CUDA it runs on the CPU, only so that tests/test_gpu_check.py can check it runs; its timings mean nothing there."""

import importlib.util
import json
import sys
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from triton import cdiv
from triton.testing import do_bench

from bench_attention import replayed
from nanoserve import LLM, SamplingParams
from nanoserve import attention as A

# CUDA for the measurements; the CPU (Triton's interpreter, tiny shapes) only for tests/test_gpu_check.py's smoke run
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 16
KV_BYTES_PER_TOKEN_BF16 = 2 * NUM_KV_HEADS * HEAD_DIM * 2  # K and V of one token in bf16, one layer
# the sweep's candidates (issue 33: prefill at least 0.75x SDPA, FP8 within 10% of bf16; long contexts at small batch
# at least 0.9x SDPA). Prefill (query rows, keys per step, pipeline stages, warps): today's setting (64 keys per step,
# as the H100 measured it on 2026-11-27), then the wide tile's candidate, the Triton fused-attention tutorial's Hopper
# choice (128 x 128, 3 stages, 8 warps: predicted 1.1-1.3x prefill TFLOP/s, never measured), and the neighbours of both
# (each row's "today" says whether it is attention.py's own setting)
PREFILL_CONFIGS = (
    (128, 64, 3, 8),
    (128, 128, 3, 8),
    (128, 128, 2, 8),
    (128, 64, 2, 8),
    (128, 64, 4, 8),
    (128, 32, 3, 8),
    (128, 64, 3, 4),
    (64, 64, 3, 4),
)
# decode (sequences, context) at small batches, and at the standard workload's (256 and 64 sequences: attention was
# 63% of its step at 1.7 TB/s), and the split counts tried beside the one decode_splits chooses
DECODE_SHAPES = ((1, 2048), (1, 8192), (1, 32768), (4, 8192), (8, 8192), (8, 32768), (16, 4096), (64, 1024), (256, 512))
SPLIT_COUNTS = (4, 8, 16, A.MAX_SPLITS)  # (the reduce holds at most MAX_SPLITS partials of a head)
DECODE_KEYS_PER_STEP = (32, 64, 128)  # decode's keys per step of its loop (DECODE_TILE_N for 16-bit q and cache)
# warps per decode program, tried at the standard workload's shapes (with today's split count, every keys per step):
# with short contexts a program is mostly its fixed costs, and fewer warps fit more programs on an SM
DECODE_WARPS = (2, 4, 8)
DECODE_WARPS_SHAPES = ((256, 512), (64, 1024))
# Qwen3-0.6B's projections: (name, out features, in features)
QWEN3_PROJECTIONS = (
    ("q|k|v", 4096, 1024),
    ("o", 1024, 2048),
    ("gate|up", 6144, 1024),
    ("down", 1024, 3072),
    ("LM head", 151936, 1024),
)
# a routing layer of Qwen3-30B-A3B (ext/moe): hidden, experts, experts per token, each expert's inner features; on a CPU
# (only the PyTorch parts timed) the tiny MoE of bench.py's --arch tiny-moe
QWEN3_30B_A3B_MOE = (2048, 128, 8, 768)
TINY_MOE = (256, 16, 2, 256)
MOE_BATCHES = (1, 8, 64, 256, 1024)  # tokens per step: batch-1 decode ... the standard workload's decode, a prefill
COPY_TBPS = (
    3.0  # the H100's measured copy bandwidth (the H100 run of 2026-11-22: BENCHMARKS.md): the memory floor's rate
)
CPU_RUNS = 20  # a CPU's MoE figures: the median of this many calls, after one


def paged_batch(query_lens, context_lens, dtype=torch.bfloat16, kv_dtype=None):
    """Random q and a paged cache holding each sequence's keys in shuffled blocks (no store), with its metadata."""
    kv_dtype = kv_dtype or dtype
    blocks = [cdiv(c, BLOCK) for c in context_lens]
    k_cache = torch.randn(sum(blocks), BLOCK, NUM_KV_HEADS, HEAD_DIM, device=DEVICE).to(kv_dtype)
    v_cache = torch.randn_like(k_cache, dtype=torch.float32).to(kv_dtype)
    tables = torch.zeros(len(blocks), cdiv(max(blocks), 16) * 16, dtype=torch.int32, device=DEVICE)
    order = torch.randperm(sum(blocks), device=DEVICE).int()
    first = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[first : first + n]
        first += n
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    ints = {"dtype": torch.int32, "device": DEVICE}
    meta = A.AttentionMetadata(
        slot_mapping=torch.full((starts[-1],), A.PAD_SLOT, **ints),
        query_start_loc=torch.tensor(starts, **ints),
        context_lens=torch.tensor(context_lens, **ints),
        block_tables=tables,
        max_query_len=max(query_lens),
        decode_only=max(query_lens) == 1,
    )
    q = torch.randn(starts[-1], NUM_HEADS, HEAD_DIM, device=DEVICE).to(dtype)
    return q, k_cache, v_cache, meta


def milliseconds(fn, graph: bool = False) -> float:
    """fn's time: Triton's do_bench on a GPU (CUDA events, the cache flushed between runs); with graph, fn captured
    once and its replays timed (bench_attention.replayed: what runs inside the engine's decode graphs, without the
    host's launch work; a capture that fails is timed eagerly and says so on stdout); one timed call on a CPU."""
    if ON_GPU:
        return replayed_ms(fn)[0] if graph else do_bench(fn)
    start = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - start)


def replayed_ms(fn) -> tuple[float, str]:
    """fn's time as milliseconds(fn, graph=True) takes it, and how: "graph", "eager" (the capture failed: compare
    such a row with a graph one at no value), or "cpu"."""
    if not ON_GPU:
        return milliseconds(fn), "cpu"
    replay, how = replayed(fn)
    return do_bench(replay), how  # (milliseconds' graph timing)


def synchronize() -> None:
    if ON_GPU:
        torch.cuda.synchronize()


def time_attention(query_lens, context_lens, graph: bool | None = None, attend=None, **kwargs) -> float:
    """paged_attention's time on a random paged batch (or attend's: ext/latency's decode); decode-only batches as
    CUDA-graph replays (as the engine runs them) unless graph says otherwise, others eagerly."""
    q, k, v, meta = paged_batch(query_lens, context_lens, **kwargs)
    graph = max(query_lens) == 1 if graph is None else graph
    attend = attend or A.paged_attention  # (read at each call: the sweep patches attention.py's names)
    return milliseconds(lambda: attend(q, k, v, meta, HEAD_DIM**-0.5), graph)


def latency_attention():
    """ext/latency's paged attention on this device (its merged decode, a programmatic dependent where the GPU has
    it), or None where the extension is not installed."""
    if importlib.util.find_spec("nanoserve.ext.latency") is None:
        return None
    from nanoserve.ext.latency import decode, gemv

    return decode.DecodeAttention(torch.device(DEVICE), gemv.dependent_launch(torch.device(DEVICE)))


def time_gemv(rows: int, out_features: int, in_features: int) -> dict:
    """One projection's weight read at `rows` rows, bf16 on a GPU (fp32 on a CPU): torch's matmul (cuBLAS) against
    ext/latency's split-K GEMV, its split planned for this device as the engine plans it, with each one's bandwidth
    (the weight's bytes over the time)."""
    from nanoserve.ext.latency import gemv as G

    dtype = torch.bfloat16 if ON_GPU else torch.float32
    weight = torch.randn(out_features, in_features, device=DEVICE).to(dtype)
    x = torch.randn(rows, in_features, device=DEVICE).to(dtype)
    split_k = G.plan(out_features, in_features, A.num_sms(torch.device(DEVICE)))
    workspace = G.Workspace(torch.device(DEVICE))
    workspace.reserve(out_features, split_k)
    # both as CUDA-graph replays, as the decode graphs run them (a few microseconds each: eagerly, the host's)
    cublas = milliseconds(lambda: torch.nn.functional.linear(x, weight), graph=True)
    gemv = milliseconds(lambda: G.gemv(x, weight, None, split_k, workspace), graph=True)
    gigabytes = weight.numel() * weight.element_size() / 1e9
    return {
        "rows": rows,
        "out": out_features,
        "in": in_features,
        "split_k": split_k,
        "cublas_ms": round(cublas, 4),
        "gemv_ms": round(gemv, 4),
        "cublas_TBps": round(gigabytes / cublas, 2),
        "gemv_TBps": round(gigabytes / gemv, 2),
        "gemv_over_cublas": round(gemv / cublas, 2),
    }


def time_chained_gemvs(rows: int, projections=QWEN3_PROJECTIONS[:4], layers: int = 28) -> dict:
    """Qwen3-0.6B's four decoder projections at `rows` rows, q|k|v -> o -> gate|up -> down (SiLU-and-mul in its
    load), each fed the one before's output, for `layers` layers back to back in one CUDA graph: a decode step's weight
    reads at batch 1 without its attention. Each launch a programmatic dependent of the one before (ext/latency's
    gemv.py, 4.: the next kernel placed and its first weight lines fetched while this one ends) against plain
    launches, in the same minute. Where the device has no dependent launch (a CPU; before sm_90) only the plain chain
    is timed."""
    from nanoserve.ext.latency import gemv as G

    dtype = torch.bfloat16 if ON_GPU else torch.float32
    num_sms = A.num_sms(torch.device(DEVICE))
    splits = [G.plan(out_features, in_features, num_sms) for _, out_features, in_features in projections]
    workspace = G.Workspace(torch.device(DEVICE))
    for (_, out_features, _), split_k in zip(projections, splits, strict=True):
        workspace.reserve(out_features, split_k)
    weights = [
        [torch.randn(out, inner, device=DEVICE).to(dtype) / inner**0.5 for _, out, inner in projections]
        for _ in range(layers)
    ]
    first = torch.randn(rows, projections[0][2], device=DEVICE).to(dtype)

    def chain() -> None:
        x = first
        for layer in weights:
            for (name, _, inner), weight, split_k in zip(projections, layer, splits, strict=True):
                silu = name == "down"  # its input is [gate | up]: gate|up's whole output
                x = G.gemv(x[:, : inner * (2 if silu else 1)], weight, None, split_k, workspace, silu)

    can_depend = workspace.dependent_launch
    workspace.dependent_launch = False
    plain, plain_timed = replayed_ms(chain)
    workspace.dependent_launch = can_depend
    dependent, dependent_timed = replayed_ms(chain) if can_depend else (None, None)
    gigabytes = sum(w.numel() * w.element_size() for layer in weights for w in layer) / 1e9
    launches = layers * len(projections)
    row = {"rows": rows, "layers": layers, "launches": launches, "plain_ms": round(plain, 4)}
    row |= {"plain_TBps": round(gigabytes / plain, 2), "dependent_ms": dependent and round(dependent, 4)}
    row |= {"plain_timed": plain_timed, "dependent_timed": dependent_timed}  # "graph"; "eager": a capture failed
    if dependent:
        row |= {"dependent_TBps": round(gigabytes / dependent, 2), "dependent_over_plain": round(dependent / plain, 3)}
        row |= {"saved_us_per_launch": round(1000 * (plain - dependent) / launches, 2)}
    return row


def time_moe(num_tokens: int, shape: tuple = QWEN3_30B_A3B_MOE, fused: bool = ON_GPU) -> dict:
    """One routing layer (ext/moe) at num_tokens rows, bf16 on a GPU (fp32 on a CPU), on a uniform random routing:
    the fused kernel (a CUDA-graph replay, as decode runs it; with fused), its grouping alone (PyTorch's sort; with
    fused also the one-program kernel, which fused_moe takes up to MAX_KERNEL_PAIRS pairs), the plain loop over
    experts (kernels.py's reference, eager: it reads each expert's rows on the host), and a dense MLP of the same active
    parameters (k x inner wide: cuBLAS). Its memory floor: the distinct experts the routing touches x an expert's bytes,
    at COPY_TBPS."""
    from nanoserve.ext.moe import kernels as M
    from nanoserve.layer_ops import silu_and_mul_ref

    hidden, num_experts, top_k, inner = shape
    dtype = torch.bfloat16 if ON_GPU else torch.float32

    def randn(*size: int) -> torch.Tensor:
        return (torch.randn(*size, device=DEVICE) / size[-1] ** 0.5).to(dtype)

    x = randn(num_tokens, hidden)
    w13 = randn(num_experts, 2 * inner, hidden)  # each expert's gate | up
    w2 = randn(num_experts, hidden, inner)
    dense_gate_up = randn(2 * top_k * inner, hidden)  # the dense peer: k experts' width in one MLP
    dense_down = randn(hidden, top_k * inner)

    def dense_mlp() -> torch.Tensor:
        return F.linear(silu_and_mul_ref(F.linear(x, dense_gate_up)), dense_down)

    def timed(fn, graph: bool = False) -> float:
        """milliseconds(fn); on a CPU the median of CPU_RUNS calls after a warm-up (the first is mostly its own)."""
        if ON_GPU:
            return milliseconds(fn, graph)
        fn()
        return sorted(milliseconds(fn) for _ in range(CPU_RUNS))[CPU_RUNS // 2]

    weights, experts = M.route(torch.randn(num_tokens, num_experts, device=DEVICE), top_k, renormalize=True)
    block_m = M.block_rows(experts.numel(), num_experts, dtype)
    grouping = timed(lambda: M.group_by_expert(experts, num_experts, block_m), graph=True)
    loop = timed(lambda: M.fused_moe_ref(x, w13, w2, weights, experts))
    dense = timed(dense_mlp, graph=True)
    distinct = len(experts.unique())
    expert_bytes = 3 * inner * hidden * x.element_size()
    floor = distinct * expert_bytes / COPY_TBPS / 1e9  # ms
    row = {
        "tokens": num_tokens,
        "experts": num_experts,
        "top_k": top_k,
        "distinct_experts": distinct,
        "formula": round(num_experts * (1 - (1 - top_k / num_experts) ** num_tokens), 1),
        "block_m": block_m,
        "floor_ms": round(floor, 4),
        "grouping_ms": round(grouping, 4),
        "loop_ms": round(loop, 4),
        "dense_same_active_ms": round(dense, 4),
    }
    if fused:  # the Triton kernels (on a CPU: the interpreter's, no figure worth reading)
        one_program = timed(lambda: M.group_by_expert_kernel(experts, num_experts, block_m), graph=True)
        row["grouping_one_program_ms"] = round(one_program, 4)
        ms = timed(lambda: M.fused_moe(x, w13, w2, weights, experts), graph=True)
        row |= {"fused_ms": round(ms, 4), "fused_TBps": round(distinct * expert_bytes / ms / 1e9, 2)}
        row |= {"fused_over_floor": round(ms / floor, 2), "fused_over_dense": round(ms / dense, 2)}
    return row


def moe(out_path: str) -> None:
    """A Qwen3-30B-A3B routing layer at MOE_BATCHES tokens (time_moe), one JSON row each."""
    rows = []
    for num_tokens in MOE_BATCHES:
        rows.append(time_moe(num_tokens, QWEN3_30B_A3B_MOE if ON_GPU else TINY_MOE))
        print(json.dumps(rows[-1]), flush=True)
    with open(out_path, "w") as f:
        json.dump(rows, f, indent=1)


def kernels(out_path: str) -> None:
    rows = []

    def report(**row) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    # 1) decode at batches that fill the GPU: one split writes the output itself (issue 30), against the same batch
    # forced to two splits (partials, merged by the reduce kernel). Prediction: one split 10-15% faster at batch
    # 128-256 (the reduce was 19 us of 143 per layer at batch 256 in the 2026-11-27 profile)
    real_splits = A.decode_splits
    for num_seqs, ctx in ((64, 1024), (128, 1024), (256, 512), (256, 1024)):
        num_sms = A.num_sms(torch.device(DEVICE))
        splits = real_splits(num_seqs, NUM_KV_HEADS, num_sms)
        now = time_attention([1] * num_seqs, [ctx] * num_seqs)
        at_least_two = max(2, splits)
        A.decode_splits = lambda *args, n=at_least_two: n
        two = time_attention([1] * num_seqs, [ctx] * num_seqs)
        A.decode_splits = real_splits
        tbps = num_seqs * ctx * KV_BYTES_PER_TOKEN_BF16 / now / 1e9
        report(
            what="decode, splits as chosen vs at least 2",
            num_seqs=num_seqs,
            context=ctx,
            splits=splits,
            ms=round(now, 4),
            two_splits_ms=round(two, 4),
            TBps=round(tbps, 2),
        )
    # 2) small batches, long contexts (issue 33: at least 0.9x SDPA; bench.py --attention has the SDPA peer)
    # (timed as graph replays, as the engine runs decode, and eagerly beside: the gap is the host's launch work), and
    # ext/latency's decode beside (its last split merges: no reduce kernel; its one-wave split rule)
    latency = latency_attention()
    for num_seqs, ctx in ((1, 2048), (1, 8192), (8, 2048), (8, 32768), (1, 32768)):
        ms = time_attention([1] * num_seqs, [ctx] * num_seqs)
        row = {"num_seqs": num_seqs, "context": ctx, "ms": round(ms, 4)}
        row["eager_ms"] = round(time_attention([1] * num_seqs, [ctx] * num_seqs, graph=False), 4)
        row["TBps"] = round(num_seqs * ctx * KV_BYTES_PER_TOKEN_BF16 / ms / 1e9, 2)
        if latency is not None:
            latency_ms = time_attention([1] * num_seqs, [ctx] * num_seqs, attend=latency)
            row |= {"latency_kernels_ms": round(latency_ms, 4), "latency_over_default": round(latency_ms / ms, 3)}
        report(what="decode, small batch", **row)
    # 3) a mixed step: 255 decodes at 1k beside one 512-token chunk, about the sum of its parts
    mixed = time_attention([512] + [1] * 255, [512] + [1024] * 255)
    decodes = time_attention([1] * 255, [1024] * 255, graph=False)  # (eager, as the mixed step and the chunk are)
    chunk = time_attention([512], [512])
    report(
        what="mixed step",
        mixed_ms=round(mixed, 4),
        decode_only_ms=round(decodes, 4),
        chunk_only_ms=round(chunk, 4),
        ratio_to_parts=round(mixed / (decodes + chunk), 2),
    )
    # 4) fp8 KV against bf16 KV, decode and prefill; fp32 prefill
    for num_seqs, ctx in ((64, 1024), (256, 1024), (64, 8192)):
        bf16 = time_attention([1] * num_seqs, [ctx] * num_seqs)
        fp8 = time_attention([1] * num_seqs, [ctx] * num_seqs, kv_dtype=torch.float8_e4m3fn)
        report(
            what="fp8 decode",
            num_seqs=num_seqs,
            context=ctx,
            bf16_ms=round(bf16, 4),
            fp8_ms=round(fp8, 4),
            fp8_over_bf16=round(fp8 / bf16, 2),
        )
    prefill = {}
    for name, dtype, kv in (
        ("bf16", torch.bfloat16, None),
        ("fp8_kv", torch.bfloat16, torch.float8_e4m3fn),
        ("fp32", torch.float32, None),
    ):
        prefill[name] = time_attention([2048] * 8, [2048] * 8, dtype=dtype, kv_dtype=kv)
    flops = 4 * 8 * NUM_HEADS * HEAD_DIM * 2048 * 2048 / 2  # QK^T and PV over the causal half
    report(
        what="prefill 8 x 2048",
        **{f"{k}_ms": round(v, 3) for k, v in prefill.items()},
        **{f"{k}_TFLOPs": round(flops / v / 1e9, 1) for k, v in prefill.items()},
    )
    # 5) the sampling kernel (ext/fused_kernels'), T = 0.6 over Qwen3's 151,936 tokens
    from nanoserve.ext import fused_kernels as FK  # here, not at the top: bench_kernels.py's modes run without it

    for num_rows in (1, 16, 256):
        logits = torch.randn(num_rows, 151936, device=DEVICE, dtype=torch.bfloat16)
        temps, seeds = [0.6] * num_rows, list(range(num_rows))
        ms = milliseconds(lambda logits=logits, temps=temps, seeds=seeds: FK.gumbel_argmax(logits, temps, seeds))
        report(what="gumbel_argmax T=0.6", rows=num_rows, ms=round(ms, 4))
    # 6) the weight reads of a few-row step (issue 33: at least 2.4 TB/s), Qwen3-0.6B's projections and LM head, by
    # ext/latency's GEMV beside cuBLAS; and a layer's four chained, as programmatic dependents or plainly
    if importlib.util.find_spec("nanoserve.ext.latency") is not None:
        for name, out_features, in_features in QWEN3_PROJECTIONS:
            for num_rows in (1, 4, 16):
                report(what=f"weight read, {name}", **time_gemv(num_rows, out_features, in_features))
        for num_rows in (1, 4):
            report(what="weight reads chained, 28 layers", **time_chained_gemvs(num_rows))
    with open(out_path, "w") as f:
        json.dump(rows, f, indent=1)


def eager(out_path: str, model_dir: str) -> None:
    """Eager runs compile nothing after warm-up (run in a fresh Triton cache): 64 requests whose decode batch shrinks
    by one each step, so every batch size and split count. Prediction: no step over 0.25 s (a compile takes 0.5-1 s)."""
    start = time.perf_counter()
    llm = LLM(model_dir, enforce_eager=True, max_model_len=4096, max_num_seqs=64)
    startup = time.perf_counter() - start
    for i in range(64):
        llm.add_request([i + 1] * 200, SamplingParams(max_tokens=i + 1, ignore_eos=True), stream=False)
    steps = []
    while llm.has_unfinished_requests():
        start = time.perf_counter()
        llm.step()
        steps.append(time.perf_counter() - start)
    row = {
        "what": "eager steps after warm-up",
        "startup_s": round(startup, 1),
        "steps": len(steps),
        "max_step_ms": round(1000 * max(steps), 1),
        "steps_over_250ms": sum(s > 0.25 for s in steps),
    }
    print(json.dumps(row))
    with open(out_path, "w") as f:
        json.dump(row, f)


@contextmanager
def patched(module, **values):
    """module's named globals set to values for the block, then restored: the launchers read them at every call."""
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def prefill_settings(tile_m: int, tile_n: int, stages: int, warps: int, itemsize: int) -> dict:
    """attention.py's prefill constants that make paged_attention launch this configuration for queries of itemsize
    bytes (8 warps: the wide-tile threshold at tile_m; 4: above it; tile_n keys per step)."""
    return {
        "PREFILL_TILE_M": {**A.PREFILL_TILE_M, itemsize: tile_m},
        "PREFILL_TILE_N": tile_n,
        "PREFILL_NUM_STAGES": stages,
        "PREFILL_WIDE_TILE_M": {**A.PREFILL_WIDE_TILE_M, itemsize: tile_m if warps == 8 else 2 * tile_m},
    }


def timed_or_nan(query_lens, context_lens, **kwargs) -> float:
    """time_attention's milliseconds, or NaN (printed with the reason) where the setting cannot run: a candidate may
    need more shared memory than an SM has (Triton's OutOfResources at launch), and the sweep goes on without it."""
    try:
        return time_attention(query_lens, context_lens, **kwargs)
    except Exception as error:  # noqa: BLE001 (any launch failure: the row says NaN, the reason is printed)
        print(f"setting failed: {type(error).__name__}: {str(error)[:200]}", flush=True)
        return float("nan")


def sweep(out_path: str, prefill_shape=(8, 2048), decode_shapes=DECODE_SHAPES, dtype=torch.bfloat16) -> list[dict]:
    """Times attention under each candidate setting (attention.py's constants patched, paged_attention as the engine
    calls it): the prefill's tiles, stages and warps on prefill_shape (sequences x tokens, causal; bf16 and an fp8
    cache; the wide tile's 128 keys per step beside today's 64), and decode's split count and keys per step (and at the
    standard workload's shapes, its warps). Each row says whether it is today's setting, and a decode row which split
    rule picks its count: the core's ceiling (today's) or ext/latency's one-wave floor (`rule`). The next session sets
    the rules from the fastest."""
    rows = []

    def add(row: dict) -> None:  # printed, and the file rewritten: a stage cut short by its timeout keeps its rows
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(out_path, "w") as f:
            json.dump(rows, f, indent=1)

    num_seqs, tokens = prefill_shape
    today_tile_m = A.PREFILL_TILE_M[dtype.itemsize]
    kv_bytes_per_token = 2 * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize  # K and V, one layer
    flops = 4 * num_seqs * NUM_HEADS * HEAD_DIM * tokens * tokens / 2  # QK^T and PV over the causal half
    today_warps = A.prefill_num_warps(today_tile_m, dtype.itemsize)
    today_prefill = (today_tile_m, A.PREFILL_TILE_N, A.PREFILL_NUM_STAGES, today_warps)  # either cache's
    for kv_dtype in (None, torch.float8_e4m3fn):
        for tile_m, tile_n, stages, warps in PREFILL_CONFIGS:
            with patched(A, **prefill_settings(tile_m, tile_n, stages, warps, dtype.itemsize)):
                ms = timed_or_nan([tokens] * num_seqs, [tokens] * num_seqs, dtype=dtype, kv_dtype=kv_dtype)
            add(
                {
                    "what": "sweep prefill" + (" fp8 cache" if kv_dtype else ""),
                    "tile_m": tile_m,
                    "tile_n": tile_n,
                    "stages": stages,
                    "warps": warps,
                    "today": (tile_m, tile_n, stages, warps) == today_prefill,
                    "ms": round(ms, 4),
                    "TFLOPs": round(flops / ms / 1e9, 1),
                }
            )
    num_sms = A.num_sms(torch.device(DEVICE))
    real_splits = A.decode_splits
    today_keys, today_warps = A.DECODE_TILE_N[dtype.itemsize, dtype.itemsize], A.DECODE_NUM_WARPS
    for seqs, ctx in decode_shapes:
        chosen = real_splits(seqs, NUM_KV_HEADS, num_sms)  # the core's rule: the ceiling, a grid a little over a wave
        floor = one_wave_splits(seqs, num_sms)  # ext/latency's: the floor, one wave at most (None: not installed)
        rules = sorted({chosen, floor or chosen})
        # (splits, keys per step, warps): every split count and step at today's warps; at the standard workload's
        # shapes, the other warp counts at both rules' split counts (fewer warps fit more programs)
        split_counts = sorted({*rules, *SPLIT_COUNTS})
        candidates = [(splits, keys, today_warps) for splits in split_counts for keys in DECODE_KEYS_PER_STEP]
        if (seqs, ctx) in DECODE_WARPS_SHAPES:
            others = [w for w in DECODE_WARPS if w != today_warps]
            candidates += [(n, k, w) for w in others for n in rules for k in DECODE_KEYS_PER_STEP]
        for splits, keys, warps in candidates:
            tile = {**A.DECODE_TILE_N, (dtype.itemsize, dtype.itemsize): keys}
            with patched(A, decode_splits=lambda *args, n=splits: n, DECODE_TILE_N=tile, DECODE_NUM_WARPS=warps):
                ms = timed_or_nan([1] * seqs, [ctx] * seqs, dtype=dtype)
            add(
                {
                    "what": "sweep decode",
                    "num_seqs": seqs,
                    "context": ctx,
                    "splits": splits,
                    "keys_per_step": keys,
                    "warps": warps,
                    "today": (splits, keys, warps) == (chosen, today_keys, today_warps),
                    "rule": split_rule(splits, chosen, floor),
                    "ms": round(ms, 4),
                    "TBps": round(seqs * ctx * kv_bytes_per_token / ms / 1e9, 2),
                }
            )
    return rows


def one_wave_splits(num_seqs: int, num_sms: int) -> int | None:
    """ext/latency's split count for a decode batch (the one-wave floor, at most its MAX_SPLITS), or None where the
    extension is not installed."""
    if importlib.util.find_spec("nanoserve.ext.latency") is None:
        return None
    from nanoserve.ext.latency import decode

    return decode.decode_splits(num_seqs, NUM_KV_HEADS, num_sms)


def split_rule(splits: int, core: int, latency: int | None) -> str:
    """Which rule picks this split count: "core" (the ceiling, today's), "latency" (ext/latency's floor), "both", or
    "" (a count the sweep tries besides)."""
    names = [name for name, count in (("core", core), ("latency", latency)) if count == splits]
    if len(names) == 2:
        return "both"
    return "".join(names)


def profile(out_path: str, model_dir: str) -> None:
    """torch.profiler's kernel tables: 3 decode-only steps at 256 sequences, 3 mixed steps (256 decodes beside 4
    prompts of 1,000), and 8 decode steps of one request (512-token prompt; CUDA graphs on, as in --latency)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    tables = []

    def profiled(name: str, llm: LLM, num_steps: int) -> None:
        synchronize()
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if ON_GPU else [ProfilerActivity.CPU]
        with torch_profile(activities=activities) as prof:
            for _ in range(num_steps):
                llm.step()
            synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total" if ON_GPU else "cpu_time_total", row_limit=30)
        tables.append(f"== {name} ({num_steps} steps)\n{table}")
        print(tables[-1], flush=True)

    llm = LLM(model_dir, max_model_len=4096)
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=64)
    llm.generate([[1] * 300] * 256, SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    for rid in range(256):
        llm.add_request([rid % 1000 + 1] * 300, params, stream=False)
    for _ in range(5):
        llm.step()
    profiled("decode, 256 sequences", llm, 3)
    for _ in range(4):
        llm.add_request([7] * 1000, params, stream=False)
    profiled("mixed: 256 decodes, 4 prompts of 1,000", llm, 3)
    for request_id in list(llm.requests):
        llm.abort(request_id)
    llm.add_request([3] * 512, SamplingParams(temperature=0, ignore_eos=True, max_tokens=64), stream=False)
    for _ in range(4):  # the prefill, then decode steps
        llm.step()
    profiled("decode, 1 request", llm, 8)
    with open(out_path, "w") as f:
        f.write("\n\n".join(tables))


if __name__ == "__main__":
    mode, out, *rest = sys.argv[1:]
    modes = {
        "kernels": lambda: kernels(out),
        "eager": lambda: eager(out, *rest),
        "profile": lambda: profile(out, *rest),
        "sweep": lambda: sweep(out),
        "moe": lambda: moe(out),
    }
    modes[mode]()
