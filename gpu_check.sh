#!/usr/bin/env bash
# Everything that needs a GPU, in one go: the GPU tests, then every benchmark, each result also saved as
# JSON under $OUT (default ./gpu-results). Stages can be picked to fit a time limit:
#   bash gpu_check.sh            # tests + bench
#   bash gpu_check.sh tests      # the test suite only (gpu-marked tests included)
#   bash gpu_check.sh bench      # the benchmarks only (standard, latency, prefix, host profile, KV report, ShareGPT,
#                                # serving at 16 requests/s)
#   bash gpu_check.sh hf         # transformers' continuous batching on 64 requests, beside nanoserve
set -uo pipefail
cd "$(dirname "$0")"
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
stages=${*:-tests bench}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(date -u +%F)"
status=0
run() { "$@" || { echo "FAILED: $*"; status=1; }; }
for stage in $stages; do
  case $stage in
    tests)
      # the whole suite: the gpu-marked tests, and the kernel and engine tests that use CUDA when present
      python3 -m pytest -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest.txt" | tail -25
      [ "${PIPESTATUS[0]}" = 0 ] || { echo "FAILED: pytest"; status=1; } ;;
    bench)
      run python3 bench.py --attention --json "$OUT/attention.json"
      run python3 bench.py --json "$OUT/throughput.json"
      run python3 bench.py --latency --json "$OUT/latency.json"
      run python3 bench.py --prefix --json "$OUT/prefix.json"
      run python3 bench.py --cpu-profile --json "$OUT/cpu_profile.json"
      run python3 bench.py --kv-report --json "$OUT/kv_report.json"
      run python3 bench.py --dataset sharegpt --json "$OUT/sharegpt.json"
      run python3 bench.py --serve --request-rate 16 --json "$OUT/serve.json" ;;
    hf) run python3 bench.py --num-seqs 64 --compare hf --json "$OUT/compare_hf.json" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
exit $status
