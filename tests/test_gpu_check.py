"""gpu_check.sh and bench_kernels.py run only on a GPU machine, whose minutes are few: a bug there costs a lease. Here
on the CPU: gpu_check.sh's bench stage with a stand-in for bench.py (a mode that fails or hangs adds no rows, in
particular never the previous mode's again, and fails the run), and bench_kernels.py's functions on tiny shapes."""

import json
import math
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

ROOT = Path(__file__).resolve().parents[1]

# A stand-in for python3: bench.py (and bench_quantization.py) writes one row naming its arguments, except that
# --latency fails and --prefix hangs; anything else (the script's own `python3 -c`) goes to the real Python.
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1" = bench.py ] || [ "$1" = bench_quantization.py ]; then
  case " $* " in
    *" --latency "*) exit 3 ;;
    *" --prefix "*) sleep 30; exit 0 ;;
  esac
  while [ $# -gt 0 ]; do [ "$1" = --json ] && json=$2; shift; done
  echo '[{"ran": true}]' > "$json"
  exit 0
fi
exec {python} "$@"
"""


def executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def fake_gpu(tmp_path: Path, fake_python: str, variables: dict[str, str]) -> dict[str, str]:
    """The environment for gpu_check.sh on a stand-in machine: python3 is fake_python (its {python} the real one), an
    nvidia-smi that names a fake GPU, both first on PATH; OUT is tmp_path/out; variables are the stage's own."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    executable(fake_bin / "python3", fake_python.replace("{python}", sys.executable))
    executable(fake_bin / "nvidia-smi", "#!/bin/sh\necho 'a fake GPU'\n")
    return os.environ | {"PATH": f"{fake_bin}:{os.environ['PATH']}", "OUT": str(tmp_path / "out")} | variables


def test_bench_stage_appends_only_the_modes_that_ran(tmp_path):
    """Guards against run() hiding a failure: `run X && append_rows` appended the previous mode's rows again after a
    failed mode, and a hung mode held the lease until it ended."""
    out = tmp_path / "out"
    env = fake_gpu(
        tmp_path,
        FAKE_PYTHON,
        {
            "BENCH_JSON": str(tmp_path / "bench.json"),
            "STEP_TIMEOUT": "2",
            "MODEL": str(tmp_path / "model"),
        },
    )
    done = subprocess.run(["bash", str(ROOT / "gpu_check.sh"), "bench"], env=env, capture_output=True, text=True)
    assert done.returncode == 1, done.stdout + done.stderr
    modes = [json.loads(line)["mode"] for line in (out / "bench.jsonl").read_text().splitlines()]
    for failed in ("latency", "latency-speculative", "latency-40k", "prefix"):
        assert failed not in modes
    for ran in ("attention", "standard", "standard-host-time", "kv-report", "kv-report-fp8", "lora", "quantization"):
        assert modes.count(ran) == 1, modes
    assert "FAILED (exit 3)" in done.stdout and "FAILED (timed out after 2 s)" in done.stdout
    assert (out / "stages.txt").read_text().startswith("== stage bench: ")


# A stand-in for python3 in the first stage: every call but the script's own (-c) is logged to $CALLS; pytest
# passes; bench.py writes the rows of the default run and ext/latency's (and, with --latency, the one without dependent
# launches), except that --attention hangs; anything else goes to the real Python.
FIRST_FAKE_PYTHON = """#!/usr/bin/env bash
[ "$1" = -c ] || echo "$*" >> "$CALLS"
if [ "$1" = -m ] && [ "$2" = pytest ]; then echo "3 passed"; exit 0; fi
if [ "$1" = bench.py ]; then
  case " $* " in
    *" --save-model "*) exit 0 ;;
    *" --attention "*) sleep 30; exit 0 ;;
  esac
  rows='{"latency_kernels": false}, {"latency_kernels": true}'
  case " $* " in *" --latency "*) rows="$rows"', {"latency_kernels": "without dependent launch"}' ;; esac
  while [ $# -gt 0 ]; do [ "$1" = --json ] && json=$2; shift; done
  echo "[$rows]" > "$json"
  exit 0
fi
exec {python} "$@"
"""


def test_first_stage_answers_in_order_within_its_limits(tmp_path):
    """Guards against the first stage (a lease's first 8 minutes) asking its questions out of order, running a command
    without its own limit (a hang would eat the lease: here the attention rows hang and are cut after their 2 s), or
    naming rows so that the default and ext/latency's runs cannot be told apart: the model saved first, then the
    gpu-marked tests with ext/latency's first, then the standard workload, batch 1 and the attention rows, each bench
    row named by its mode and, for ext/latency's runs, by its kernels."""
    import time

    out = tmp_path / "out"
    calls = tmp_path / "calls.txt"
    env = fake_gpu(
        tmp_path,
        FIRST_FAKE_PYTHON,
        {
            "BENCH_JSON": str(tmp_path / "bench.json"),
            "MODEL": str(tmp_path / "model"),
            "CALLS": str(calls),
        },
    )
    for limit in ("SAVE_LIMIT", "GPU_TESTS_LIMIT", "STANDARD_LIMIT", "LATENCY_LIMIT", "ATTENTION_LIMIT"):
        env[limit] = "2"  # each command's own, in seconds
    started = time.monotonic()
    done = subprocess.run(["bash", str(ROOT / "gpu_check.sh"), "first"], env=env, capture_output=True, text=True)
    assert time.monotonic() - started < 20, "a hung command held the stage past its limit"
    assert done.returncode == 1 and "FAILED (timed out after 2 s)" in done.stdout, done.stdout + done.stderr
    assert [line.split(" --json")[0] for line in calls.read_text().splitlines()] == [
        f"bench.py --arch qwen3-0.6b --save-model {tmp_path / 'model'}",
        "-m pytest -q -p no:cacheprovider -rs -m gpu tests/ext/test_latency.py tests --ignore=tests/ext/test_moe.py",
        f"bench.py --model {tmp_path / 'model'} --latency-kernels",
        f"bench.py --model {tmp_path / 'model'} --latency --latency-kernels",
        "bench.py --attention",
    ]
    modes = [json.loads(line)["mode"] for line in (out / "bench.jsonl").read_text().splitlines()]
    assert modes == [
        "standard",
        "standard+latency-kernels",
        "latency",
        "latency+latency-kernels",
        "latency+latency-kernels-no-pdl",
    ]
    assert "3 passed" in (out / "tests-gpu.txt").read_text()
    assert (out / "stages.txt").read_text().startswith("== stage first: ")


# A stand-in for python3 in ext/moe's stages: every call but the script's own (-c) logged to $CALLS; pytest passes;
# bench_kernels.py writes its file; bench.py --save-model makes the folder, unless $SAVE_FAILS, when it leaves half a
# folder and fails; bench.py --model needs the saved folder and writes one row.
MOE_FAKE_PYTHON = """#!/usr/bin/env bash
[ "$1" = -c ] || echo "$*" >> "$CALLS"
if [ "$1" = -m ] && [ "$2" = pytest ]; then echo "9 passed"; exit 0; fi
if [ "$1" = bench_kernels.py ]; then echo "[]" > "$3"; exit 0; fi
if [ "$1" = bench.py ]; then
  case " $* " in
    *" --save-model "*) mkdir -p "$5"; [ -z "$SAVE_FAILS" ] || exit 4; touch "$5/config.json"; exit 0 ;;
    *" --model "*) [ -f "$3/config.json" ] || exit 5 ;;
  esac
  while [ $# -gt 0 ]; do [ "$1" = --json ] && json=$2; shift; done
  echo '[{"ran": true}]' > "$json"
  exit 0
fi
exec {python} "$@"
"""


def test_moe_stages_save_the_model_once_and_name_their_rows(tmp_path):
    """Guards against ext/moe's GPU stages wasting a lease: a save cut short leaving a folder the next call would
    trust (then every engine run fails), the model saved again on a warm machine, or rows not named by their mode.
    Without a GPU's numbers, the stand-in checks the order of the calls, the files and the rows."""
    out, calls, model = tmp_path / "out", tmp_path / "calls.txt", tmp_path / "moe"
    env = fake_gpu(
        tmp_path,
        MOE_FAKE_PYTHON,
        {
            "BENCH_JSON": str(tmp_path / "bench.json"),
            "MOE_MODEL": str(model),
            "CALLS": str(calls),
        },
    )
    script = ["bash", str(ROOT / "gpu_check.sh")]
    failed = subprocess.run([*script, "moe-model"], env=env | {"SAVE_FAILS": "1"}, capture_output=True, text=True)
    assert failed.returncode == 1 and not model.exists() and not (out / "bench.jsonl").exists(), failed.stdout
    calls.unlink()
    for _ in range(2):  # the second call finds the model saved
        done = subprocess.run([*script, "moe", "moe-model"], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
    save = f"bench.py --arch qwen3-30b-a3b-12l --save-model {model}.part"
    engine = [f"bench.py --model {model} --latency", f"bench.py --model {model}"]
    once = ["-m pytest -q -p no:cacheprovider -rs -m gpu tests/ext/test_moe.py", f"bench_kernels.py moe {out}/moe.json"]
    logged = [line.split(" --json")[0] for line in calls.read_text().splitlines()]
    assert logged == [*once, save, *engine, *once, *engine]
    modes = [json.loads(line)["mode"] for line in (out / "bench.jsonl").read_text().splitlines()]
    assert modes == ["moe-latency", "moe-standard"] * 2 and (model / "config.json").exists()
    assert "9 passed" in (out / "tests-moe.txt").read_text() and (out / "moe.json").exists()


# A stand-in for python3 in the kv stage: bench.py --save-model makes the folder; bench_kv.py writes a row naming its
# mode, except that offload fails after writing (its rows must not be kept).
KV_FAKE_PYTHON = """#!/usr/bin/env bash
[ "$1" = -c ] || echo "$*" >> "$CALLS"
if [ "$1" = bench.py ]; then mkdir -p "$5"; touch "$5/config.json"; exit 0; fi
if [ "$1" = bench_kv.py ]; then
  mode=$2
  while [ $# -gt 0 ]; do [ "$1" = --json ] && json=$2; shift; done
  echo "[{\\"mode\\": \\"$mode\\"}, {\\"mode\\": \\"$mode\\"}]" > "$json"
  [ "$mode" = offload ] && exit 6
  exit 0
fi
exec {python} "$@"
"""


def test_kv_stage_keeps_the_rows_of_the_modes_that_ran(tmp_path):
    """Guards against the kv stage wasting a lease: the model not saved before bench_kv.py needs it, a failed mode's
    rows kept (or a previous mode's appended again), or a failure that does not fail the run."""
    out, calls, model = tmp_path / "out", tmp_path / "calls.txt", tmp_path / "qwen3"
    env = fake_gpu(
        tmp_path,
        KV_FAKE_PYTHON,
        {
            "KV_JSON": str(tmp_path / "kv.json"),
            "MODEL": str(model),
            "CALLS": str(calls),
        },
    )
    done = subprocess.run(["bash", str(ROOT / "gpu_check.sh"), "kv"], env=env, capture_output=True, text=True)
    assert done.returncode == 1 and "FAILED (exit 6): python3 bench_kv.py offload" in done.stdout, done.stdout
    logged = [line.split(" --model")[0] for line in calls.read_text().splitlines()]
    assert logged == [
        f"bench.py --arch qwen3-0.6b --save-model {model}",
        "bench_kv.py swap-rule",
        "bench_kv.py offload",
    ]
    modes = [json.loads(line)["mode"] for line in (out / "kv.jsonl").read_text().splitlines()]
    assert modes == ["swap-rule", "swap-rule"]


@pytest.fixture(scope="module")
def bench_kernels():
    sys.path.insert(0, str(ROOT))
    import bench_kernels

    return bench_kernels


def test_bench_kernels_attention_on_tiny_shapes(bench_kernels):
    """paged_batch builds a valid paged batch (its attention matches the reference) and time_attention times it."""
    from nanoserve import attention as A

    q, k, v, meta = bench_kernels.paged_batch([1, 3], [40, 19], dtype=torch.float32)
    scale = bench_kernels.HEAD_DIM**-0.5
    got = A.paged_attention(q, k, v, meta, scale)
    want = A.paged_attention_ref(q, k, v, meta, scale)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    assert bench_kernels.time_attention([1, 1], [33, 17], dtype=torch.float32) > 0


def test_bench_kernels_times_the_latency_kernels(bench_kernels):
    """time_gemv times cuBLAS's matmul and ext/latency's GEMV on one projection, with the split the engine plans;
    time_chained_gemvs a layer's projections back to back, launched plainly and (on a GPU that has it) as programmatic
    dependents; time_attention times ext/latency's decode attention where it is given it (the kernels mode's small
    batch rows put it beside the core's)."""
    pytest.importorskip("nanoserve.ext.latency")
    row = bench_kernels.time_gemv(3, 40, 600)
    assert row["split_k"] > 1 and row["cublas_ms"] > 0 and row["gemv_ms"] > 0 and "gemv_TBps" in row
    attend = bench_kernels.latency_attention()
    assert bench_kernels.time_attention([1, 1], [33, 17], attend=attend, dtype=torch.float32) > 0
    # a layer's four projections chained over two layers (each fed the last's output), plain launches only on a CPU
    tiny = (("q|k|v", 96, 40), ("o", 40, 48), ("gate|up", 64, 40), ("down", 40, 32))
    row = bench_kernels.time_chained_gemvs(2, tiny, layers=2)
    assert row["launches"] == 8 and row["plain_ms"] > 0 and row["dependent_ms"] is None and row["plain_timed"] == "cpu"


def test_bench_kernels_sweep_times_each_setting_and_restores_today(bench_kernels, monkeypatch, tmp_path):
    """The sweep on tiny shapes (two prefill settings, two split counts, one key step): a row per setting, today's
    marked once per group, each setting really reaching the launcher (its constants as paged_attention reads them),
    and attention.py's constants as they were afterwards."""
    from nanoserve import attention as A

    names = ("PREFILL_TILE_M", "PREFILL_TILE_N", "PREFILL_NUM_STAGES", "PREFILL_WIDE_TILE_M")
    before = [getattr(A, name) for name in (*names, "DECODE_TILE_N")]
    settings = bench_kernels.prefill_settings(64, 32, 2, 4, 4)
    with bench_kernels.patched(A, **settings):
        assert (A.PREFILL_TILE_M[4], A.PREFILL_TILE_N, A.PREFILL_NUM_STAGES) == (64, 32, 2)
        assert A.prefill_num_warps(64, 4) == 4
    with bench_kernels.patched(A, **bench_kernels.prefill_settings(16, 16, 3, 8, 4)):
        assert A.prefill_num_warps(16, 4) == 8 and A.PREFILL_TILE_N == 16
    assert [getattr(A, name) for name in (*names, "DECODE_TILE_N")] == before
    today_prefill = (A.PREFILL_TILE_M[4], A.PREFILL_TILE_N, A.PREFILL_NUM_STAGES, 8)  # fp32's (32 rows: 8 warps)
    assert A.prefill_num_warps(A.PREFILL_TILE_M[4], 4) == 8
    # the wide tile's candidate, 128 keys per step, is a row of the sweep beside today's 64
    assert (128, 128, 3, 8) in bench_kernels.PREFILL_CONFIGS and A.PREFILL_TILE_N == 64
    monkeypatch.setattr(bench_kernels, "PREFILL_CONFIGS", (today_prefill, (16, 16, 2, 4)))
    monkeypatch.setattr(bench_kernels, "SPLIT_COUNTS", (2,))
    monkeypatch.setattr(bench_kernels, "DECODE_KEYS_PER_STEP", (A.DECODE_TILE_N[4, 4],))
    rows = bench_kernels.sweep(str(tmp_path / "sweep.json"), (1, 20), ((1, 40),), torch.float32)
    assert json.loads((tmp_path / "sweep.json").read_text()) == rows
    prefill = [r for r in rows if r["what"] == "sweep prefill"]
    decode = [r for r in rows if r["what"] == "sweep decode"]
    num_sms = A.num_sms(torch.device(bench_kernels.DEVICE))
    chosen = A.decode_splits(1, bench_kernels.NUM_KV_HEADS, num_sms)  # the core's ceiling
    floor = bench_kernels.one_wave_splits(1, num_sms)  # ext/latency's floor; None where it is not installed
    assert len(prefill) == 2 and len(decode) == len({2, chosen, floor or chosen}) and len(rows) == 2 * 2 + len(decode)
    assert [r["today"] for r in prefill] == [True, False] and sum(r["today"] for r in decode) == 1
    # each decode row says which rule picks its count: the core's is today's
    assert [r["splits"] for r in decode if r["rule"] in ("core", "both")] == [chosen]
    assert [r["splits"] for r in decode if r["rule"] in ("latency", "both")] == [floor] * (floor is not None)
    assert all(r["ms"] > 0 for r in rows)
    assert [getattr(A, name) for name in (*names, "DECODE_TILE_N")] == before
    # at a shape named for it, the warps too: each candidate's warps reach the launcher, and today's come back
    launched = []
    real_kernel = A._decode_split_kernel

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(kwargs["num_warps"])
                return real_kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(A, "_decode_split_kernel", Recording())
    monkeypatch.setattr(bench_kernels, "DECODE_WARPS_SHAPES", ((1, 40),))
    monkeypatch.setattr(bench_kernels, "DECODE_WARPS", (2, A.DECODE_NUM_WARPS))
    monkeypatch.setattr(bench_kernels, "PREFILL_CONFIGS", ())
    warps_rows = bench_kernels.sweep(str(tmp_path / "warps.json"), (1, 20), ((1, 40),), torch.float32)
    other_warps = [2] * len(
        {chosen, floor or chosen}
    )  # at both rules' split counts (the core's alone without ext/latency)
    assert sorted(r["warps"] for r in warps_rows) == sorted([A.DECODE_NUM_WARPS] * len(decode) + other_warps)
    assert launched == [r["warps"] for r in warps_rows] and A.DECODE_NUM_WARPS == 4  # (one launch a row on a CPU)
    assert sum(r["today"] for r in warps_rows) == 1


def test_decode_and_weight_reads_are_timed_as_graph_replays(bench_kernels, monkeypatch):
    """On a GPU, what the engine runs inside its decode graphs (decode-only attention, the few-row weight reads) is
    timed as replays of a captured graph, and what it runs eagerly (prefill, mixed steps) eagerly: with do_bench and
    the capture stood in for, each call says which it asked for."""
    pytest.importorskip("nanoserve.ext.latency")
    asked = []

    def stand_in_replayed(fn):
        asked.append("graph")
        return fn, "graph"

    monkeypatch.setattr(bench_kernels, "ON_GPU", True)

    def stand_in_do_bench(fn) -> float:
        fn()
        return 1.0

    monkeypatch.setattr(bench_kernels, "do_bench", stand_in_do_bench)
    monkeypatch.setattr(bench_kernels, "replayed", stand_in_replayed)

    def asks(call) -> list[str]:
        asked.clear()
        call()
        return list(asked)

    assert asks(lambda: bench_kernels.time_attention([1, 1], [33, 17], dtype=torch.float32)) == ["graph"]
    assert asks(lambda: bench_kernels.time_attention([1, 1], [33, 17], graph=False, dtype=torch.float32)) == []
    assert asks(lambda: bench_kernels.time_attention([5, 1], [33, 17], dtype=torch.float32)) == []
    assert asks(lambda: bench_kernels.time_gemv(2, 40, 600)) == ["graph", "graph"]  # cuBLAS's and the GEMV's


def test_a_setting_that_cannot_run_is_a_nan_row(bench_kernels, monkeypatch):
    """A sweep candidate whose launch fails (more shared memory than an SM has, on a GPU) times as NaN, and the sweep
    goes on."""
    from nanoserve import attention as A

    def out_of_resources(*args, **kwargs):
        raise RuntimeError("out of resource: shared memory")

    monkeypatch.setattr(A, "paged_attention", out_of_resources)
    assert math.isnan(bench_kernels.timed_or_nan([1], [20], dtype=torch.float32))


def test_bench_kernels_eager_and_profile_run(bench_kernels, tmp_path):
    """The eager and profile modes on a tiny model with Qwen3's layout (4,096 positions, as they ask for)."""
    config = Qwen3Config(
        vocab_size=1024,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    bench_kernels.eager(str(tmp_path / "eager.json"), str(tmp_path / "model"))
    row = json.loads((tmp_path / "eager.json").read_text())
    assert row["steps"] >= 64 and row["max_step_ms"] > 0
    bench_kernels.profile(str(tmp_path / "profile.txt"), str(tmp_path / "model"))
    tables = (tmp_path / "profile.txt").read_text()
    assert tables.count("== ") == 3 and "aten::" in tables
