"""Benchmarks of K/V that moves (ext/kv_offload, ext/kv_transfer). Each mode prints a table, then one JSON line of all
rows (--json FILE also writes them); every row names its device, date and commit.

    python bench_kv.py offload       # multi-turn chat in a device pool too small for every conversation: prefill
                                     # tokens computed and seconds per turn, without and with the host tier
    python bench_kv.py swap-rule     # a prefix copied back from the host tier against the same prefix recomputed,
                                     # per prompt length: measured, beside what the swap rule predicts and chooses
    python bench_kv.py disagg        # long prompts and long outputs arriving while others decode: decode inter-token
                                     # latency p50/p99, one engine (all threads) against the pair (a thread each)
    python bench_kv.py predict       # no device: the swap rule's costs per token for Qwen3-0.6B and an 8B shape on an
                                     # H100 (PCIe 5 x16 against bf16 prefill), from the figures in PREDICTION

The model: --model DIR, the embedded default model (--model default, the CPU's default), or --arch (random weights,
bench.py's shapes and llama-8b; --num-layers cuts a shape's layers: both the copy and the recompute scale with them)."""

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from nanoserve import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent
ARCH_8B = {  # Llama-3-8B's public shape
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}
# The H100 prediction's figures (predict): each is a public figure or a stated guess, to be replaced by gpu_check.sh's
# measurement (bench_kv.py swap-rule on the GPU prints the measured copy_s_per_token and FLOP rate)
PREDICTION = {
    "device": "H100 SXM (predicted)",
    "copy_bytes_per_s": 50e9,  # pinned host-to-device over PCIe 5.0 x16: 64 GB/s raw, ~50 GB/s achieved
    "flops_per_s": 400e12,  # bf16 prefill matmuls at ~40% of the 989 TFLOP/s dense peak (a small model's width)
    "kv_bytes": 2,  # bf16
}
SEED = 47


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU, {os.cpu_count()} cores"


def commit() -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def stamp(row: dict) -> dict:
    """A row with its device, date and commit."""
    return {**row, "device": device_name(), "date": datetime.date.today().isoformat(), "commit": commit()}


def model_dir(args) -> str:
    """--model (default: the embedded default model), or --arch with random weights saved once in a temp folder."""
    if args.arch is None:
        from nanoserve.loader import resolve_model_dir

        return resolve_model_dir(None if args.model == "default" else args.model)
    sys.path.insert(0, str(ROOT))
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    import bench

    if args.arch == "llama-8b":
        config = LlamaConfig(**ARCH_8B)
    else:
        config = Qwen3Config(**bench.ARCHS[args.arch])
    if args.num_layers:
        config.num_hidden_layers = args.num_layers
    path = tempfile.mkdtemp(prefix=f"nanoserve-{args.arch}-")
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path)
    return path


def random_ids(n: int, vocab: int) -> list[int]:
    """n random token ids of a vocabulary of this size, past the first 100 (special tokens)."""
    return [random.randrange(100, vocab) for _ in range(n)]


def vocab_size(path: str) -> int:
    return json.loads((Path(path) / "config.json").read_text())["vocab_size"]


def engine_options(args) -> dict:
    options = {"max_model_len": args.max_model_len}
    if args.threads:
        options["threads"] = args.threads
    return options


# ---- offload: multi-turn chat ----------------------------------------------------------------------------------------
def run_offload(args, path: str) -> list[dict]:
    """args.conversations conversations take args.turns turns; each turn sends every conversation whole (its history,
    the answer so far, a new user message of args.user_tokens), all at once, answered with args.answer_tokens greedy
    tokens. The device pool holds args.pool_conversations conversations at their longest, so each turn's history has
    been evicted by the others': recomputed without the host tier, copied back with it. args.rounds rounds of the two,
    in turn (none, tier, tier, none, ...); a row per tier and turn, its seconds the median of the rounds."""
    longest = args.turns * (args.user_tokens + args.answer_tokens) + args.first_tokens
    pool = int(args.pool_conversations * -(-longest // 16)) + 1
    runs = {None: [], args.offload_gib: []}
    for round_ in range(args.rounds):
        order = list(runs)
        if round_ % 2:
            order.reverse()
        for gib in order:
            runs[gib].append(chat_turns(args, path, pool, gib))
    answers = {gib: [turn["answers"] for turn in done[0]] for gib, done in runs.items()}
    assert answers[None] == answers[args.offload_gib], "the host tier changed an answer"
    rows = []
    for gib, done in runs.items():
        for turn, measured in enumerate(zip(*done, strict=True)):
            row = {key: value for key, value in measured[-1].items() if key != "answers"}
            row["seconds"] = round(statistics.median(m["seconds"] for m in measured), 3)
            host_tier = "none" if gib is None else f"{gib:g} GiB"
            rows.append(stamp({"mode": "offload", "host_tier": host_tier, "turn": turn, **row, "device_blocks": pool}))
    return rows


def chat_turns(args, path: str, pool: int, gib: float | None) -> list[dict]:
    """One engine's run of the conversations (run_offload): per turn its prompt tokens, the prefill tokens it computed,
    its seconds, the answers, and the host tier's counters after it."""
    random.seed(SEED)
    params = SamplingParams(temperature=0, max_tokens=args.answer_tokens, ignore_eos=True)
    llm = LLM(path, num_kvcache_blocks=pool, kv_offloading_size=gib, **engine_options(args))
    histories = [random_ids(args.first_tokens, args.vocab) for _ in range(args.conversations)]
    turns = []
    for _ in range(args.turns):
        for history in histories:
            history += random_ids(args.user_tokens, args.vocab)
        computed, started = llm.stats()["computed_tokens"], time.perf_counter()
        outs = llm.generate(histories, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        decodes = args.conversations * (args.answer_tokens - 1)
        turn = {
            "prompt_tokens": sum(map(len, histories)),
            "prefill_tokens_computed": llm.stats()["computed_tokens"] - computed - decodes,
            "seconds": seconds,
            "answers": [out.outputs[0].token_ids for out in outs],
        }
        if gib is not None:
            turn |= {k.removeprefix("kv_offload_"): v for k, v in llm.extensions["kv_offload"].stats().items()}
        for history, out in zip(histories, outs, strict=True):
            history += out.outputs[0].token_ids
        turns.append(turn)
    llm.close()
    return turns


# ---- swap-rule: copy back or recompute -------------------------------------------------------------------------------
def run_swap_rule(args, path: str) -> list[dict]:
    """Per prompt length L: the prompt is computed, then evicted to the host tier by another one of the same length (a
    device pool of one such prompt), then sent again with one more token, timed: its blocks copied back from the host
    tier, or (the rule overruled) recomputed. The fastest of args.repeats each, beside the swap rule's prediction of
    both and its choice."""
    from nanoserve.ext import kv_offload

    rows = []
    one_token = SamplingParams(temperature=0, max_tokens=1)
    for length in args.lengths:
        blocks = length // 16 + 2
        llm = LLM(path, num_kvcache_blocks=blocks, kv_offloading_size=args.offload_gib, **engine_options(args))
        tier = llm.extensions["kv_offload"]
        measured_rule = tier.rule
        timings = {}
        for mode, rule in (("copy", kv_offload.SwapRule(0.0, 1.0, 0.0)), ("recompute", kv_offload.SwapRule(1.0, 0, 0))):
            tier.rule = rule
            best = float("inf")
            for repeat in range(args.repeats):
                random.seed(SEED + repeat)
                prompt, other = random_ids(length, args.vocab), random_ids(length, args.vocab)
                llm.generate([prompt], one_token, use_tqdm=False)
                llm.generate([other], one_token, use_tqdm=False)  # evicts the prompt's blocks to the host tier
                started = time.perf_counter()
                llm.generate([prompt + random_ids(1, args.vocab)], one_token, use_tqdm=False)
                best = min(best, time.perf_counter() - started)
            timings[mode] = best
        full = length // 16
        copy_only = kv_offload.fastest(partial(copy_back, llm, full), llm.runner.device)
        tokens = full * 16
        keys = tokens * (tokens + 1) // 2
        predicted_copy = tokens * measured_rule.copy_s_per_token
        predicted_recompute = tokens * measured_rule.recompute_s_per_token + keys * measured_rule.recompute_s_per_key
        row = {
            "mode": "swap-rule",
            "prompt_tokens": length,
            "loaded_tokens": tokens,
            "ttft_copy_back_s": round(timings["copy"], 4),
            "ttft_recompute_s": round(timings["recompute"], 4),
            "copy_only_s": round(copy_only, 6),
            "measured_speedup": round(timings["recompute"] / timings["copy"], 2),
            "rule_copy_s": float(f"{predicted_copy:.3g}"),
            "rule_recompute_s": float(f"{predicted_recompute:.3g}"),
            "rule_chooses": "copy" if measured_rule.copy_beats_recompute(0, tokens) else "recompute",
            "measured_winner": "copy" if timings["copy"] < timings["recompute"] else "recompute",
            "copy_s_per_token": float(f"{measured_rule.copy_s_per_token:.3g}"),
            "recompute_s_per_token": float(f"{measured_rule.recompute_s_per_token:.3g}"),
        }
        rows.append(stamp(row))
        llm.close()
    return rows


def copy_back(llm, num_blocks: int) -> None:
    """The copies alone: num_blocks blocks from the host pool into the device's first ones (BlockCopies)."""
    from nanoserve.ext import kv_offload

    tier = llm.extensions["kv_offload"]
    copies = kv_offload.BlockCopies(llm.runner)
    for i in range(num_blocks):
        copies.load(tier.blocks[i % tier.num_blocks], i)
    copies.run()


# ---- predict: the H100 -----------------------------------------------------------------------------------------------
def predicted_costs(shape: dict, figures: dict) -> dict:
    """The swap rule's three costs for a model shape on a device of these figures (SwapRule.measured's formulas)."""
    hidden, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q_width = shape["num_attention_heads"] * shape["head_dim"]
    kv_width = shape["num_key_value_heads"] * shape["head_dim"]
    kv_bytes_per_token = 2 * layers * kv_width * figures["kv_bytes"]
    matmul_flops = 2 * layers * (hidden * (2 * q_width + 2 * kv_width) + 3 * hidden * inter)
    key_flops = 4 * layers * q_width
    return {
        "kv_bytes_per_token": kv_bytes_per_token,
        "copy_s_per_token": kv_bytes_per_token / figures["copy_bytes_per_s"],
        "recompute_s_per_token": matmul_flops / figures["flops_per_s"],
        "recompute_s_per_key": key_flops / figures["flops_per_s"],
    }


def run_predict(args) -> list[dict]:
    """For each shape: the costs per token, and from which prefix length copying back beats recomputing it (the
    rule's crossover: never, from the first token, or from the length where attention's share tips it)."""
    sys.path.insert(0, str(ROOT))
    import bench

    rows = []
    for name, shape in (("qwen3-0.6b", bench.ARCHS["qwen3-0.6b"]), ("llama-8b", ARCH_8B)):
        costs = predicted_costs(shape, PREDICTION)
        copy, token, key = costs["copy_s_per_token"], costs["recompute_s_per_token"], costs["recompute_s_per_key"]
        # copying n tokens from 0 beats recomputing them when n c < n t + n(n+1)/2 k, i.e. n > 2 (c - t) / k - 1
        crossover = max(1, int(2 * (copy - token) / key))
        rows.append(
            {
                "mode": "predict",
                "model": name,
                "device": PREDICTION["device"],
                "kv_KiB_per_token": round(costs["kv_bytes_per_token"] / 1024, 1),
                "copy_us_per_token": round(copy * 1e6, 3),
                "recompute_us_per_token": round(token * 1e6, 3),
                "attention_ns_per_key": round(key * 1e9, 4),
                "copy_beats_recompute_from_tokens": crossover,
                "pcie_GB_per_s": PREDICTION["copy_bytes_per_s"] / 1e9,
                "prefill_TFLOP_per_s": PREDICTION["flops_per_s"] / 1e12,
                "date": datetime.date.today().isoformat(),
                "commit": commit(),
            }
        )
    return rows


# ---- disagg: the pair against one engine --------------------------------------------------------------------------
def workload(args) -> list[tuple[float, list[int]]]:
    """(arrival second, prompt) per request: a long prompt every args.interval seconds."""
    random.seed(SEED)
    return [(i * args.interval, random_ids(args.prompt_tokens, args.vocab)) for i in range(args.requests)]


def drive(llm, requests: list[tuple[float, list[int]]], params: SamplingParams, t0: float) -> dict[str, list[float]]:
    """Add each request at its arrival time (from t0, time.time()), step until all have finished; returns each
    request's token times (time.monotonic())."""
    pending = list(requests)
    times: dict[str, list[float]] = {}
    while pending or llm.has_unfinished_requests():
        now = time.time() - t0
        while pending and pending[0][0] <= now:
            _, prompt = pending.pop(0)
            times[llm.add_request(prompt, params, stream=True)] = []
        if not llm.has_unfinished_requests():
            time.sleep(min(0.01, max(0.0, pending[0][0] - now)))
            continue
        for out in llm.step():
            times[out.request_id] += [time.monotonic()] * len(out.outputs[0].token_ids_delta)
    return times


def latencies(times: dict[str, list[float]]) -> dict:
    gaps = sorted(b - a for stamps in times.values() for a, b in zip(stamps, stamps[1:], strict=False))
    q = statistics.quantiles(gaps, n=100)
    return {
        "itl_p50_ms": round(1000 * q[49], 1),
        "itl_p99_ms": round(1000 * q[98], 1),
        "tokens": sum(map(len, times.values())),
    }


def run_disagg(args, path: str) -> list[dict]:
    """The same requests through one engine, with all of the machine's threads (args.threads, the same hardware as
    the pair) and with one engine's share of the pair's (args.pair_threads), and through the pair: two processes of
    args.pair_threads each, started as torchrun starts its ranks."""
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    requests = workload(args)
    options = {"max_model_len": args.max_model_len, "max_num_batched_tokens": args.step_tokens}
    rows = []
    for threads in dict.fromkeys((args.threads or os.cpu_count(), args.pair_threads)):
        llm = LLM(path, threads=threads, **options)
        llm.generate([random_ids(32, args.vocab)], params, use_tqdm=False)  # warm
        started = time.perf_counter()
        one = latencies(drive(llm, requests, params, time.time()))
        seconds = round(time.perf_counter() - started, 2)
        llm.close()
        rows.append(stamp({"mode": "disagg", "engines": f"one ({threads} threads)", **one, "seconds": seconds}))
    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "decode.json"
        env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        env["PYTHONPATH"] = str(ROOT)
        command = [sys.executable, str(ROOT / "bench_kv.py"), "disagg-rank", "--result", str(result), "--model", path]
        command += [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in RANK_FLAGS and v is not None]
        ranks = [subprocess.Popen(command, env=dict(env, RANK=str(rank), LOCAL_RANK="0")) for rank in (0, 1)]
        try:
            wait_for_both(ranks)
        finally:  # a rank that failed leaves its peer waiting for it: ended here, never left behind
            for rank in ranks:
                rank.kill()
                rank.wait()
        pair = json.loads(result.read_text())
    engines = f"pair ({args.pair_threads} threads each)"
    rows.append(
        stamp(
            {
                "mode": "disagg",
                "engines": engines,
                **pair["latencies"],
                "seconds": pair["seconds"],
                "loaded_blocks": pair["loaded_blocks"],
            }
        )
    )
    return rows


def wait_for_both(ranks: list[subprocess.Popen]) -> None:
    """Until both ranks have exited; the first to fail fails the run at once."""
    while any(rank.poll() is None for rank in ranks):
        if any(rank.poll() not in (None, 0) for rank in ranks):
            raise RuntimeError(f"a rank of the pair failed: exit statuses {[rank.poll() for rank in ranks]}")
        time.sleep(0.2)
    if any(rank.returncode != 0 for rank in ranks):
        raise RuntimeError(f"a rank of the pair failed: exit statuses {[rank.returncode for rank in ranks]}")


RANK_FLAGS = ("requests", "interval", "prompt_tokens", "output_tokens", "max_model_len", "step_tokens", "pair_threads")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_disagg_rank(args) -> None:
    """One rank of the pair: rank 0 prefills each request as it arrives (one token), rank 1 decodes it; both start
    the schedule at one moment agreed in the rendezvous store; rank 1 writes its latencies to args.result."""
    rank = int(os.environ["RANK"])
    role = ("kv_producer", "kv_consumer")[rank]
    args.vocab = vocab_size(args.model)
    options = {"max_model_len": args.max_model_len, "max_num_batched_tokens": args.step_tokens}
    llm = LLM(args.model, threads=args.pair_threads, kv_transfer_config={"kv_role": role}, **options)
    store = llm.extensions["kv_transfer"].link.store
    store.add("bench/ready", 1)
    while store.add("bench/ready", 0) < 2:
        time.sleep(0.01)
    if rank == 0:
        store.set("bench/t0", str(time.time() + 0.5))
    t0 = float(store.get("bench/t0"))
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    if rank == 0:
        params = SamplingParams(temperature=0, max_tokens=1)
    started = time.perf_counter()
    times = drive(llm, workload(args), params, t0)
    if rank == 1:
        stats = llm.extensions["kv_transfer"].stats()
        result = {
            "latencies": latencies(times),
            "seconds": round(time.perf_counter() - started, 2),
            "loaded_blocks": stats["kv_transfer_blocks_loaded"],
        }
        Path(args.result).write_text(json.dumps(result))
    llm.extensions["kv_transfer"].link.close(wait_s=60)


# ---- the command line ----------------------------------------------------------------------------------------------
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["offload", "swap-rule", "disagg", "predict", "disagg-rank"])
    parser.add_argument("--model", default="default")
    parser.add_argument("--arch", choices=["qwen3-0.6b", "tiny", "llama-8b"])
    parser.add_argument("--num-layers", type=int, help="cut --arch to this many layers")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--threads", type=int, help="CPU torch threads (one engine)")
    parser.add_argument("--offload-gib", type=float, default=1.0, help="kv_offloading_size")
    parser.add_argument("--json", help="also write the rows here")
    # offload
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first-tokens", type=int, default=200, help="each conversation's first message")
    parser.add_argument("--user-tokens", type=int, default=40, help="each later user message")
    parser.add_argument("--answer-tokens", type=int, default=24)
    parser.add_argument("--pool-conversations", type=float, default=1.5, help="device pool, in longest conversations")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each, in turn (none, tier, tier, none, ...)")
    # swap-rule
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    # disagg
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between arrivals")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--step-tokens", type=int, default=512, help="max_num_batched_tokens")
    parser.add_argument("--pair-threads", type=int, default=1, help="CPU torch threads per engine of the pair")
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def print_table(rows: list[dict]) -> None:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(str(row.get(c, "")).rjust(widths[c]) for c in columns))


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.mode == "disagg-rank":
        run_disagg_rank(args)
        return []
    if args.mode == "predict":
        rows = run_predict(args)
    else:
        path = model_dir(args)
        args.vocab = vocab_size(path)
        runs = {"offload": run_offload, "swap-rule": run_swap_rule, "disagg": run_disagg}
        rows = runs[args.mode](args, path)
    print_table(rows)
    print(json.dumps(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
