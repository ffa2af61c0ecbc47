"""Offline throughput benchmark: the standard small-engine workload (256 random requests), plus modes for a
peer comparison (--compare hf), shared-prefix caching (--prefix), single-request latency (--latency),
host-side step costs (--cpu-profile) and the attention kernels (--attention).

    python bench.py                        # Qwen3-0.6B shape, random weights, on the GPU
    python bench.py --arch tiny --num-seqs 8 --max-input-len 64 --max-output-len 16   # CPU smoke test
"""
import argparse
import json
import random
import shutil
import tempfile
import time

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.model_runner import InFlightStep

STANDARD_NUM_SEQS = 256         # the standard workload's size
PROMPT_ID_RANGE = 10000          # prompt token ids are uniform in [0, PROMPT_ID_RANGE] (nano-vllm's bench)
MIN_LEN = 100                    # prompt and output lengths are uniform in [MIN_LEN, --max-*-len]
PREFIX_QUESTION_LEN = 64         # --prefix: per-request question after the shared system prompt...
PREFIX_ANSWER_LEN = 64           # ...and the answer's length
LATENCY_PROMPT_LEN, LATENCY_NEW_TOKENS = 512, 256
HF_RESULT_TIMEOUT_S = 600        # --compare hf: longest wait for one finished request

ARCHS = {  # public configs; the weights are random, which with ignore_eos does not change throughput
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True),
    "tiny": dict(vocab_size=10240, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=8192, tie_word_embeddings=True),
}


def random_model_dir(arch: str) -> str:
    from transformers import AutoModelForCausalLM, Qwen3Config
    path = tempfile.mkdtemp(prefix=f"nanoserve-{arch}-")
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    AutoModelForCausalLM.from_config(Qwen3Config(**ARCHS[arch]), dtype=dtype).save_pretrained(path)
    return path


def standard_workload(num_seqs, max_input_len, max_output_len):
    """nano-vllm's bench.py workload: random prompt ids and lengths, then random output lengths.

    Always drawn for at least STANDARD_NUM_SEQS requests, so --num-seqs 64 means the first 64 of the standard
    256 (33,322 output tokens), the subset the H100 peer figures quote."""
    random.seed(0)
    drawn = max(num_seqs, STANDARD_NUM_SEQS)
    low_in, low_out = min(MIN_LEN, max_input_len), min(MIN_LEN, max_output_len)  # smoke-test sizes allowed
    prompts = [[random.randint(0, PROMPT_ID_RANGE) for _ in range(random.randint(low_in, max_input_len))]
               for _ in range(drawn)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=random.randint(low_out, max_output_len))
              for _ in range(drawn)]
    return prompts[:num_seqs], params[:num_seqs]


def timed_generate(llm, prompts, params):
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    return outs, time.perf_counter() - start


def result_row(name, llm, outs, seconds):
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    s = llm.stats()
    return {"run": name, "requests": len(outs), "output_tokens": tokens, "seconds": round(seconds, 2),
            "tok_per_s": round(tokens / seconds, 1), "kv_blocks": s["kv_blocks_total"],
            "peak_kv_use": f"{s['kv_blocks_peak'] / s['kv_blocks_total']:.0%}",
            "prefix_hit_rate": f"{s['prefix_hit_rate']:.0%}", "preemptions": s["preemptions"]}


def reset_counters(llm):
    bm = llm.block_manager
    bm.prefix_hit_tokens = bm.prefix_queried_tokens = bm.peak_used_blocks = 0
    llm.scheduler.num_preemptions = 0


def run_throughput(llm, args):
    prompts, params = standard_workload(args.num_seqs, args.max_input_len, args.max_output_len)
    reset_counters(llm)
    outs, seconds = timed_generate(llm, prompts, params)
    return [result_row("nanoserve", llm, outs, seconds)]


def run_prefix(llm, args):
    """One 2,048-token system prompt shared by every request, a 64-token question, 64 tokens of answer."""
    random.seed(0)
    system = [random.randint(0, PROMPT_ID_RANGE) for _ in range(args.prefix_len)]
    prompts = [system + [random.randint(0, PROMPT_ID_RANGE) for _ in range(PREFIX_QUESTION_LEN)]
               for _ in range(args.num_seqs)]
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=PREFIX_ANSWER_LEN)
    rows = []
    for caching in (False, True):
        llm.block_manager.enable_prefix_caching = caching
        reset_counters(llm)
        outs, seconds = timed_generate(llm, prompts, params)
        rows.append(result_row(f"prefix caching {'on' if caching else 'off'}", llm, outs, seconds))
    print(f"prefix caching speed-up (wall time off / on): {rows[0]['seconds'] / rows[1]['seconds']:.1f}x")
    return rows


def run_latency(llm, args):
    """One request alone: 512-token prompt, 256 new greedy tokens; decode rate excludes the first token."""
    random.seed(0)
    prompt = [[random.randint(0, PROMPT_ID_RANGE) for _ in range(LATENCY_PROMPT_LEN)]]
    greedy = dict(temperature=0, ignore_eos=True)
    llm.block_manager.enable_prefix_caching = False  # both runs compute the prompt, no cache hit
    _, t_first = timed_generate(llm, prompt, SamplingParams(max_tokens=1, **greedy))
    reset_counters(llm)
    outs, t_all = timed_generate(llm, prompt, SamplingParams(max_tokens=LATENCY_NEW_TOKENS, **greedy))
    row = result_row("latency (1 request)", llm, outs, t_all)
    row["decode_tok_per_s"] = round((LATENCY_NEW_TOKENS - 1) / (t_all - t_first), 1)
    row["first_token_ms"] = round(t_first * 1000, 1)
    return [row]


def run_cpu_profile(llm, args):
    """Host time per loop iteration, split by stage, over all iterations and over decode-only ones (the
    ones the 1 ms target is about). An iteration schedules and launches step n+1 (the GPU only queues it),
    then reads step n back: 'wait' is the host idling for those tokens, the rest is host work, which
    overlaps the GPU's work as long as 'wait' stays above zero."""
    stages = ("schedule", "prepare", "launch", "wait", "finish")
    steps = []  # per iteration: {stage: seconds, "decode_only": bool}
    sched, runner = llm.scheduler, llm.runner

    def timed(stage, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            result = fn(*a, **k)
            if stage == "schedule":
                steps.append({"decode_only": all(s.num_new_tokens == 1 for s in result.scheduled)})
            if steps:
                steps[-1][stage] = steps[-1].get(stage, 0.0) + time.perf_counter() - start
            return result
        return wrapper
    for obj, stage, name in ((sched, "schedule", "schedule"), (runner, "prepare", "prepare"),
                             (runner, "launch", "launch"), (llm, "finish", "_finish")):
        setattr(obj, name, timed(stage, getattr(obj, name)))
    wait = InFlightStep.wait
    InFlightStep.wait = lambda self: timed("wait", wait)(self)
    try:
        rows = run_throughput(llm, args)
    finally:
        InFlightStep.wait = wait
    for step in steps:
        step["launch"] = step.get("launch", 0.0) - step.get("prepare", 0.0)  # launch calls prepare
        step["finish"] = step.get("finish", 0.0) - step.get("wait", 0.0)    # _finish calls wait
    for name, chosen in (("all", steps), ("decode-only", [s for s in steps if s["decode_only"]])):
        rows[0][f"{name}_steps"] = len(chosen)
        for stage in stages:
            ms = 1000 * sum(s.get(stage, 0.0) for s in chosen) / max(len(chosen), 1)
            rows[0][f"{name}_{stage}_ms"] = round(ms, 3)
    return rows


def run_compare_hf(model_dir, args):
    """The same requests through transformers' continuous batching (paged attention over SDPA, prefix sharing off).

    This is `generate_batch`'s own loop (warm-up, start, add requests, collect results) written out, because
    generate_batch takes one max_new_tokens for all requests and the workload gives each its own."""
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="paged|sdpa", dtype=dtype).to(device)
    prompts, params = standard_workload(args.num_seqs, args.max_input_len, args.max_output_len)
    config = GenerationConfig(do_sample=True, temperature=0.6, max_new_tokens=args.max_output_len, eos_token_id=-1)
    hints = WorkloadHints(max_prompt_length=max(map(len, prompts)), max_generated_length=args.max_output_len,
                          num_requests=len(prompts))  # what generate_batch sizes its cache from
    manager = model.init_continuous_batching(generation_config=config, workload_hints=hints,
                                             continuous_batching_config=ContinuousBatchingConfig(
                                                 allow_block_sharing=False))
    manager.warmup()  # its CUDA-graph capture, outside the timed run as ours is
    manager.start()
    start = time.perf_counter()
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=p.max_tokens)
    tokens, done = 0, 0
    while done < len(prompts):
        result = manager.get_result(timeout=HF_RESULT_TIMEOUT_S)
        if result is None:
            raise RuntimeError("transformers' continuous batching stopped before finishing")
        if result.is_finished():
            tokens, done = tokens + len(result.generated_tokens), done + 1
    seconds = time.perf_counter() - start
    manager.stop(block=True)
    return [{"run": "transformers continuous batching", "requests": len(prompts), "output_tokens": tokens,
             "seconds": round(seconds, 2), "tok_per_s": round(tokens / seconds, 1)}]


def print_table(rows):
    columns = list(dict.fromkeys(k for row in rows for k in row))
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(str(row.get(c, "")).rjust(widths[c]) for c in columns))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model directory (default: --arch with random weights)")
    ap.add_argument("--arch", choices=sorted(ARCHS), default="qwen3-0.6b")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--prefix-len", type=int, default=2048, help="shared prompt length for --prefix")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--compare", choices=["hf"], help="also run the standard requests through transformers")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--prefix", action="store_true", help="shared 2k-token system prompt, caching on vs off")
    mode.add_argument("--latency", action="store_true", help="one request: 512 prompt, 256 new tokens")
    mode.add_argument("--cpu-profile", action="store_true", help="host ms per step by stage")
    mode.add_argument("--attention", action="store_true", help="the attention kernels beside SDPA")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.compare and (args.prefix or args.latency or args.attention):
        ap.error("--compare runs the standard workload; use it without --prefix/--latency/--attention")

    if args.attention:
        from bench_attention import run_attention_bench
        rows = run_attention_bench()
    else:
        model_dir = args.model or random_model_dir(args.arch)
        temporary = args.model is None
        if not args.model:
            print(f"model: {args.arch} architecture with random weights "
                  "(ignore_eos: throughput does not depend on them)")
        llm = LLM(model_dir, max_model_len=args.max_model_len, max_num_seqs=min(args.num_seqs, 256),
                  enforce_eager=args.enforce_eager)
        llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=16), use_tqdm=False)  # warm-up
        run = run_prefix if args.prefix else run_latency if args.latency else \
            run_cpu_profile if args.cpu_profile else run_throughput
        rows = run(llm, args)
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        for row in rows:
            row["device"] = device
        if args.compare == "hf":
            del llm
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            rows += run_compare_hf(model_dir, args)
            print(f"nanoserve / transformers: {rows[0]['tok_per_s'] / rows[-1]['tok_per_s']:.1f}x")
        if temporary:
            shutil.rmtree(model_dir, ignore_errors=True)
    print_table(rows)
    print(json.dumps(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
