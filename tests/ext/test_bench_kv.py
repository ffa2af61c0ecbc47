"""bench_kv.py (the host tier's and the disaggregated pair's benchmarks) runs end to end on the CPU at tiny sizes, so a
broken benchmark shows up in CI, not on the GPU. Each mode's rows must say what the run did; nothing here depends on
timing."""

import sys
from pathlib import Path

from conftest import extension_or_skip

extension_or_skip("kv_offload")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import bench_kv  # noqa: E402 (bench_kv.py lives at the repository root)

TINY = ["--arch", "tiny", "--max-model-len", "1024"]


def test_offload_computes_less_prefill_with_the_host_tier(capsys):
    """Guards against a multi-turn benchmark that measures nothing: later turns compute fewer prefill tokens with the
    host tier than without (their histories copied back), the first turn the same, and every row names its device,
    date and commit."""
    rows = bench_kv.main(
        ["offload", *TINY, "--conversations", "3", "--turns", "3", "--first-tokens", "60", "--user-tokens", "10"]
        + ["--answer-tokens", "4", "--rounds", "1"]
    )
    by = {(row["host_tier"], row["turn"]): row for row in rows}
    assert by[("none", 0)]["prefill_tokens_computed"] == by[("1 GiB", 0)]["prefill_tokens_computed"]
    for turn in (1, 2):
        assert by[("1 GiB", turn)]["prefill_tokens_computed"] < by[("none", turn)]["prefill_tokens_computed"]
        assert by[("1 GiB", turn)]["blocks_loaded"] > 0
    assert all({"device", "date", "commit", "seconds"} <= set(row) for row in rows)
    assert capsys.readouterr().out.splitlines()[-1].startswith("[{")  # the JSON line


def test_swap_rule_rows_compare_the_rule_with_the_measurement():
    """Guards against a swap-rule benchmark whose rows cannot be read: per length, both times, the rule's two
    predictions and its choice, and which one the measurement found faster."""
    rows = bench_kv.main(["swap-rule", *TINY, "--lengths", "32", "64", "--repeats", "1"])
    assert [row["prompt_tokens"] for row in rows] == [32, 64]
    for row in rows:
        assert row["ttft_copy_back_s"] > 0 and row["ttft_recompute_s"] > 0 and row["copy_only_s"] > 0
        assert row["rule_chooses"] in ("copy", "recompute") and row["measured_winner"] in ("copy", "recompute")
        assert row["loaded_tokens"] == row["prompt_tokens"] // 16 * 16


def test_predict_finds_where_copying_back_wins():
    """Guards against a prediction that contradicts its own figures: Qwen3-0.6B's copy and recompute costs per token
    are close, so copying wins only past a crossover length; an 8B shape's recompute costs far more per token, so
    copying wins from the first token."""
    rows = {row["model"]: row for row in bench_kv.main(["predict"])}
    small, large = rows["qwen3-0.6b"], rows["llama-8b"]
    assert small["kv_KiB_per_token"] == 112.0 and large["kv_KiB_per_token"] == 128.0  # 28 x 8 x 128 x 2 x 2 bytes
    assert small["copy_beats_recompute_from_tokens"] > 1
    assert large["copy_beats_recompute_from_tokens"] == 1
    assert large["recompute_us_per_token"] > 10 * large["copy_us_per_token"]


def test_disagg_runs_one_engine_and_the_pair():
    """Guards against a disaggregation benchmark that does not run the pair or loads nothing: rows for one engine and
    the pair, each with inter-token latencies over every decoded token, and the pair's decode engine loaded blocks."""
    extension_or_skip("kv_transfer")
    rows = bench_kv.main(
        ["disagg", *TINY, "--requests", "2", "--interval", "0.2", "--prompt-tokens", "40", "--output-tokens", "4"]
        + ["--threads", "2", "--pair-threads", "1"]
    )
    assert [row["engines"] for row in rows] == ["one (2 threads)", "one (1 threads)", "pair (1 threads each)"]
    assert all(row["tokens"] == 2 * 4 for row in rows)
    assert rows[-1]["loaded_blocks"] == 2 * 2
