"""The Triton kernels compile for an H100 (sm_90) with the installed Triton, on any machine (tests/sm90_build.py).

CI has no GPU, so this is its only check that the compiled path, not the interpreter, still builds; it also
guards the properties the kernels' speed rests on: no register spills, K/V streamed by 16-byte asynchronous
copies (software-pipelined), wgmma for prefill tiles of 64+ rows, and
a decode program small enough (registers and shared memory) that PROGRAMS_PER_SM of them fit on one SM at once."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanoserve.attention import DECODE_NUM_WARPS, PREFILL_TILE_M, PROGRAMS_PER_SM

H100_REGISTERS_PER_SM = 65536
H100_SHARED_BYTES_PER_SM = 228 * 1024
SHAPES = {"qwen3-0.6b bf16, block 16": "bf16:128:2:16", "llama-style fp16 GQA 8, block 256": "fp16:64:8:256"}


@pytest.fixture(scope="module")
def builds() -> dict:
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the real kernels, not the interpreter
    script = Path(__file__).with_name("sm90_build.py")
    done = subprocess.run(
        [sys.executable, str(script), *SHAPES.values()], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    return {
        name: [r for r in rows if f"{r['dtype']}:{r['head_dim']}:{r['group']}:{r['block_size']}" == shape]
        for name, shape in SHAPES.items()
    }


@pytest.mark.parametrize("shape", SHAPES)
def test_every_kernel_compiles_for_h100(builds, shape):
    """Guards against a kernel that only the interpreter accepts, or one whose variants stopped building."""
    kernels = [r["kernel"] for r in builds[shape]]
    assert kernels.count("_prefill_kernel") >= 4  # query tiles 16 .. PREFILL_TILE_M
    assert {
        "_store_kv_kernel",
        "_decode_split_kernel",
        "_decode_reduce_kernel",
        "_add_rms_norm_kernel",
        "_qk_norm_rope_kernel",
        "_silu_mul_kernel",
        "_gumbel_argmax_kernel",
    } <= set(kernels)


@pytest.mark.parametrize("shape", SHAPES)
def test_hot_kernels_do_not_spill_and_prefill_uses_wgmma(builds, shape):
    """Guards against tile or code changes that push the hot loops into local memory or off the tensor cores."""
    for r in builds[shape]:
        prefill = r["kernel"] == "_prefill_kernel"
        if not prefill or r["tile_m"] == PREFILL_TILE_M:  # small prefill tiles serve only short chunks
            assert r["spill_bytes"] == 0, r
        if prefill and r["tile_m"] >= 64:
            assert r["wgmma"], r
        # K/V tiles stream in as 16-byte asynchronous copies, tiles ahead of use (the 4-byte ones: block ids)
        if r["kernel"] == "_decode_split_kernel" or r["tile_m"] == PREFILL_TILE_M:
            assert 16 in r["async_copy_bytes"] and set(r["async_copy_bytes"]) <= {4, 16}, r
    decode = next(r for r in builds[shape] if r["kernel"] == "_decode_split_kernel")
    assert PROGRAMS_PER_SM * DECODE_NUM_WARPS * 32 * decode["registers"] <= H100_REGISTERS_PER_SM, decode
    assert PROGRAMS_PER_SM * decode["shared_bytes"] <= H100_SHARED_BYTES_PER_SM, decode
