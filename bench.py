"""nanoserve's benchmark CLI. Each run prints a progress line, then a table, then one JSON line of all rows (--json
FILE also writes them). Without a GPU the flags left out take CPU sizes, and a line says so.

    python bench.py                          # GPU: the standard workload (256 random requests, Qwen3-0.6B shape,
                                             # random weights); no GPU: 24 ShareGPT chat prompts x 40 greedy tokens
    python bench.py --arch tiny --num-seqs 8 --max-input-len 64 --max-output-len 16     # a seconds-long smoke test
    python bench.py --dataset sharegpt       # ShareGPT's prompt and output lengths (vLLM's filters), 1,000 requests
    python bench.py --serve --request-rate 4             # the OpenAI server in-process, Poisson arrivals: TTFT, ITL
    python bench.py --compare hf             # the same requests through transformers' continuous batching
    python bench.py --compare hf-sequential  # ... through transformers' generate, one prompt at a time
    python bench.py --busy 2 --compare hf-sequential     # the same beside 2 CPU-burning processes
    python bench.py --kv-report              # KV memory wasted, contiguous vs paged; prefill saved by the prefix cache;
                                             # the pool: bytes per token, tokens it holds (--kv-cache-dtype fp8: twice)
    python bench.py --plot plots/            # the run's step trace as pictures (nanoserve/ext/plots.py)
    python bench.py --prefix                 # a 2k-token system prompt shared by every request, caching off vs on
                                             # vs on with cascade attention (ext/cascade.py)
    python bench.py --loras 4                # the requests with no adapter, then spread over 4 random LoRA adapters
    python bench.py --latency                # one request: 512 prompt + 256 greedy tokens
    python bench.py --cpu-profile            # host ms per engine step, by stage
    python bench.py --op-profile             # torch.profiler over the run: the top operators by self CPU time
    python bench.py --attention              # the paged attention kernels beside SDPA (CUDA)
    python bench.py --tp 2 --threads 4       # tensor parallelism; CPU torch threads
    python bench.py --dataset repeat --speculative ngram --max-num-seqs 1
                                             # speculative decoding beside the same run without it, on requests
                                             # whose answers copy their input (repeat, correct, reformat a text)
    python bench.py --latency --speculative ngram       # one request, with and without n-gram drafts
    python bench.py --latency --latency-kernels          # one request, the core's kernels, then ext/latency's
                                             # (on sm_90 and later also without its dependent launches)
"""

import argparse
import importlib.util
import json
import logging
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from nanoserve import LLM, SamplingParams, ext
from nanoserve.model_runner import InFlightStep

STANDARD_NUM_SEQS, STANDARD_MAX_LEN = 256, 1024  # the standard workload: requests, longest prompt and output
SHAREGPT_NUM_SEQS = 1000  # --dataset sharegpt on a GPU (vLLM's benchmark default)
CPU_NUM_SEQS, CPU_NEW_TOKENS = 24, 40  # no GPU: requests and tokens each (the "course edition" issue's case)
CHAT_PROMPT_LENS = (16, 200)  # --dataset chat: the templated first human turns kept are this long
# --dataset repeat: requests whose answers reuse their input, speculative decoding's best case. Each is a task (in
# turn) and a ShareGPT answer of REPEAT_TEXT_LENS tokens as the text; REPEAT_NUM_SEQS prompts x REPEAT_NEW_TOKENS greedy
REPEAT_TASKS = (
    "Repeat the following text exactly, word for word.",
    "Correct any spelling or grammar mistakes in the following text, and write out the whole corrected text.",
    "Rewrite the following text with each sentence on a line of its own, keeping every word.",
    "Copy the following text, then stop.",
)
REPEAT_TEXT_LENS = (80, 240)
REPEAT_NUM_SEQS, REPEAT_NEW_TOKENS = 32, 128
SPECULATIVE_TOKENS, PROMPT_LOOKUP_MAX = 4, 4  # --speculative's drafts per step and longest n-gram looked up
MAX_NUM_SEQS = 256  # the engine's batch limit
SEED = 0
PROMPT_ID_RANGE = 10000  # random prompt ids are uniform in [0, PROMPT_ID_RANGE] (nano-vllm's bench)
MIN_LEN = 100  # random prompt and output lengths are uniform in [MIN_LEN, --max-*-len]
RANDOM_TEMPERATURE = 0.6  # the random workload samples; the ShareGPT ones are greedy
PREFIX_QUESTION_LEN, PREFIX_ANSWER_LEN = 64, 64  # --prefix: per request, after the shared system prompt
LATENCY_PROMPT_LEN, LATENCY_NEW_TOKENS = 512, 256
WARMUP_PROMPTS, WARMUP_TOKENS = 4, 16
OP_PROFILE_ROWS = 12  # --op-profile: operators listed
HF_RESULT_TIMEOUT_S = 600  # --compare hf: longest wait for one finished request
HF_MAX_BATCH_TOKENS, HF_PAGE_SIZE = 8192, 256  # ...transformers' defaults (our batch budget is 8192 too)
BUSY_START_S = 0.5  # --busy: the burners spin before the engine counts free cores
LORA_RANK = 16  # --loras: the adapters' rank, on q/k/v/o
LORA_REPEATS = 2  # --loras: each run twice, alternating with its peer, the faster kept (the CPU VM is noisy)
VLLM_CLAIMS = "vLLM's announcement: 60-80% wasted by contiguous reservation, under 4% with paging"
DEFAULT_THREADS = torch.get_num_threads()  # torch's own choice, before the engine sets its count

ARCHS = {  # public configs; the weights are random, which with ignore_eos does not change throughput
    "qwen3-0.6b": {
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
    "tiny": {
        "vocab_size": 10240,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
    # mixture of experts (ext/moe): each token through 8 of 128 experts of 768 inner features; 30.5B parameters, 3.3B
    # active per token (61 GB in bf16: its random save needs that much disk)
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,  # (no dense layer: every layer routes)
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    # a tiny MoE for the CPU (2 of 16 experts), and a dense model of the same active parameters (MLP 2 x 256 wide)
    "tiny-moe": {
        "model_type": "qwen3_moe",
        "vocab_size": 10240,
        "hidden_size": 256,
        "intermediate_size": 512,  # (unused: every layer routes)
        "moe_intermediate_size": 256,
        "num_experts": 16,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
}
# Qwen3-30B-A3B cut to 12 of its 48 layers (15 GB in bf16), what a GPU machine with a 64 GiB disk can save: each
# layer is the whole model's, so its time per layer and its ratio to the memory floor stand for the whole model's
ARCHS["qwen3-30b-a3b-12l"] = ARCHS["qwen3-30b-a3b"] | {"num_hidden_layers": 12}
MOE_FIELDS = ("model_type", "moe_intermediate_size", "num_experts", "num_experts_per_tok", "norm_topk_prob")
ARCHS["tiny-moe-dense"] = {key: value for key, value in ARCHS["tiny-moe"].items() if key not in MOE_FIELDS}


@dataclass
class Workload:
    prompts: list[list[int]]  # token ids
    params: list[SamplingParams]
    kind: str  # what the requests are, for the header line

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def description(self) -> str:
        return f"{len(self.prompts)} {self.kind} ({self.prompt_tokens:,} prompt tokens)"


# ---- models and workloads --------------------------------------------------------------------------------------
def resolve_defaults(args, gpu: bool) -> bool:
    """Fill in the flags left out: the standard workload on a GPU; without one, CPU sizes, and with neither --model
    nor --arch the CPU workload (the default model's chat). True when it is the CPU workload."""
    cpu_default = not gpu and args.model is None and args.arch is None
    if cpu_default:
        args.model = "default"
    args.arch = args.arch or "qwen3-0.6b"
    if args.dataset is None:
        args.dataset = "sharegpt" if args.serve else "chat" if cpu_default else "random"
    if args.num_seqs is None:
        args.num_seqs = (
            REPEAT_NUM_SEQS
            if args.dataset == "repeat"
            else CPU_NUM_SEQS
            if not gpu
            else SHAREGPT_NUM_SEQS
            if args.dataset == "sharegpt"
            else STANDARD_NUM_SEQS
        )
    if args.max_output_len is None and args.dataset == "repeat":
        args.max_output_len = REPEAT_NEW_TOKENS
    if args.max_output_len is None:  # sharegpt on a GPU: the dataset's lengths
        args.max_output_len = (
            CPU_NEW_TOKENS
            if not gpu or args.dataset == "chat"
            else STANDARD_MAX_LEN
            if args.dataset == "random"
            else None
        )
    return cpu_default


def model_dir_of(args) -> tuple[str, bool]:
    """(directory, temporary): the embedded default model, an HF directory, or --arch with random weights."""
    from nanoserve.loader import resolve_model_dir

    if args.model is not None:
        return resolve_model_dir(None if args.model == "default" else args.model), False
    path = tempfile.mkdtemp(prefix=f"nanoserve-{args.arch}-")
    save_random_model(args.arch, path)
    return path, True


def save_random_model(arch: str, path: str) -> None:
    """A random-weight model of --arch, saved as an HF folder (bf16 on a GPU, fp32 on a CPU); Qwen3 unless the preset
    names another model_type."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(ARCHS[arch])
    config = AutoConfig.for_model(fields.pop("model_type", "qwen3"), **fields)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(path)


def random_workload(num_seqs, max_input_len, max_output_len) -> Workload:
    """nano-vllm's bench.py workload: random prompt ids and lengths, then random output lengths.

    Always drawn for at least STANDARD_NUM_SEQS requests, so --num-seqs 64 means the first 64 of the standard
    256 (33,322 output tokens), the subset the H100 peer figures quote."""
    random.seed(SEED)
    drawn = max(num_seqs, STANDARD_NUM_SEQS)
    low_in, low_out = min(MIN_LEN, max_input_len), min(MIN_LEN, max_output_len)  # smoke-test sizes allowed
    prompts = [
        [random.randint(0, PROMPT_ID_RANGE) for _ in range(random.randint(low_in, max_input_len))] for _ in range(drawn)
    ]
    params = [
        SamplingParams(
            temperature=RANDOM_TEMPERATURE, ignore_eos=True, max_tokens=random.randint(low_out, max_output_len)
        )
        for _ in range(drawn)
    ]
    return Workload(prompts[:num_seqs], params[:num_seqs], f"random requests, outputs {low_out}..{max_output_len}")


def sharegpt_workload(tokenizer, num_seqs, max_output_len) -> Workload:
    """vLLM's ShareGPT requests (bench_serve.py), greedy with ignore_eos so outputs have the dataset's lengths."""
    from bench_serve import sharegpt_requests

    requests = sharegpt_requests(tokenizer, num_seqs, SEED, max_output_len, token_ids=True)
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=n) for _, _, n in requests]
    clip = f", outputs clipped to {max_output_len}" if max_output_len else ""
    return Workload([ids for ids, _, _ in requests], params, f"ShareGPT requests, greedy{clip}")


def chat_workload(tokenizer, num_seqs, new_tokens) -> Workload:
    """ShareGPT's first human turns in a seeded shuffle, through the chat template as LLM.chat applies it: the first
    num_seqs whose templated length lies in CHAT_PROMPT_LENS, new_tokens greedy tokens each."""
    from bench_serve import first_exchange, sharegpt_conversations

    if not getattr(tokenizer, "chat_template", None):
        raise SystemExit("--dataset chat needs a model with a chat template (--model default, or an HF directory)")
    exchanges = [e for e in map(first_exchange, sharegpt_conversations()) if e is not None]
    random.Random(SEED).shuffle(exchanges)
    prompts = []
    for question, _ in exchanges:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer.encode(text, add_special_tokens=False)
        if CHAT_PROMPT_LENS[0] <= len(ids) <= CHAT_PROMPT_LENS[1]:
            prompts.append(ids)
        if len(prompts) == num_seqs:
            break
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=new_tokens)] * len(prompts)
    return Workload(prompts, params, f"ShareGPT chat prompts x {new_tokens} greedy tokens")


def repeat_workload(tokenizer, num_seqs, new_tokens) -> Workload:
    """Requests whose answers reuse their input: each a task of REPEAT_TASKS (in turn) and a text, a ShareGPT answer
    in a seeded shuffle REPEAT_TEXT_LENS tokens long, through the chat template; new_tokens greedy tokens each (the
    text, or its corrected or reformatted copy, is where the answer's n-grams come from)."""
    from bench_serve import first_exchange, sharegpt_conversations

    if not getattr(tokenizer, "chat_template", None):
        raise SystemExit("--dataset repeat needs a model with a chat template (--model default, or an HF directory)")
    exchanges = [e for e in map(first_exchange, sharegpt_conversations()) if e is not None]
    random.Random(SEED).shuffle(exchanges)
    prompts = []
    for _, answer in exchanges:
        if not REPEAT_TEXT_LENS[0] <= len(tokenizer.encode(answer, add_special_tokens=False)) <= REPEAT_TEXT_LENS[1]:
            continue
        task = REPEAT_TASKS[len(prompts) % len(REPEAT_TASKS)]
        message = [{"role": "user", "content": f"{task}\n\n{answer}"}]
        prompts.append(tokenizer.apply_chat_template(message, add_generation_prompt=True, return_dict=False))
        if len(prompts) == num_seqs:
            break
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=new_tokens)] * len(prompts)
    return Workload(prompts, params, f"repeat/correct/reformat-a-text prompts x {new_tokens} greedy tokens")


def build_workload(args, llm) -> Workload:
    if args.dataset == "random":
        return random_workload(args.num_seqs, args.max_input_len, args.max_output_len)
    tokenizer = llm.tokenizer
    if args.model is None:  # random weights: the default model's tokenizer measures the lengths (the loader gives
        from nanoserve.loader import load_tokenizer, resolve_model_dir  # a weights-only directory an empty one)

        tokenizer = load_tokenizer(resolve_model_dir(None))
    make = {"chat": chat_workload, "repeat": repeat_workload}.get(args.dataset, sharegpt_workload)
    workload = make(tokenizer, args.num_seqs, args.max_output_len)
    if args.model is None:  # folded into the random model's vocabulary: with random weights only lengths count
        workload.prompts = [[t % llm.vocab_size for t in ids] for ids in workload.prompts]
    return workload


# ---- nanoserve's runs ------------------------------------------------------------------------------------------
def timed_generate(llm, prompts, params, lora_request=None):
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
    sync()
    return outs, time.perf_counter() - start


def result_row(name, llm, outs, seconds):
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    s = llm.stats()
    return {
        "run": name,
        "requests": len(outs),
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
        "output_tokens": tokens,
        "seconds": round(seconds, 2),
        "tok_per_s": round(tokens / seconds, 1),
        "threads": torch.get_num_threads(),
        "kv_blocks": s["kv_blocks_total"],
        "peak_kv_use": f"{s['kv_blocks_peak'] / s['kv_blocks_total']:.0%}",
        "prefix_hit_rate": f"{s['prefix_hit_rate']:.0%}",
        "preemptions": s["preemptions"],
        "steps": s["steps"],
    } | speculation_columns(s, tokens, s["steps"])


def speculation_columns(stats, output_tokens, steps) -> dict:
    """With speculative decoding: tokens per step, drafts proposed and the share of them accepted, and the mean run
    of accepted drafts per sequence and step (nothing without it)."""
    if "spec_proposed_tokens" not in stats:
        return {}
    return {
        "tokens_per_step": round(output_tokens / max(steps, 1), 2),
        "drafts": stats["spec_proposed_tokens"],
        "accepted": f"{stats['spec_acceptance_rate']:.0%}",
        "mean_accepted_len": round(stats["spec_mean_accepted_length"], 2),
    }


def reset_counters(llm):
    bm = llm.block_manager
    bm.prefix_hit_tokens = bm.prefix_queried_tokens = bm.peak_used_blocks = 0
    llm.scheduler.num_preemptions = 0
    llm.num_steps = 0
    if llm.proposer is not None:  # speculative decoding's totals
        llm.proposer.num_proposed = llm.proposer.num_accepted = llm.proposer.num_runs = 0


def run_throughput(llm, workload, args):
    print(f"running nanoserve: {workload.description}", flush=True)
    reset_counters(llm)
    outs, seconds = timed_generate(llm, workload.prompts, workload.params)
    return [result_row("nanoserve", llm, outs, seconds)]


def run_op_profile(llm, workload, args):
    """The throughput run under torch.profiler: the operators that take the most self CPU time, as a table (share,
    calls, ms per call), so a CPU-path change can say what it moved."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        rows = run_throughput(llm, workload, args)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total_us = sum(e.self_cpu_time_total for e in events)
    print(f"torch.profiler: {total_us / 1e6:.2f} s of CPU time; top operators by self time")
    print(f"{'operator':<48} {'share':>7} {'calls':>8} {'ms/call':>8}")
    for event in events[:OP_PROFILE_ROWS]:
        share = event.self_cpu_time_total / total_us
        per_call_ms = event.self_cpu_time_total / max(event.count, 1) / 1000
        print(f"{event.key[:48]:<48} {share:>7.1%} {event.count:>8} {per_call_ms:>8.3f}")
    rows[0]["profiled_cpu_s"] = round(total_us / 1e6, 2)
    return rows


def run_prefix(llm, workload, args):
    """One 2,048-token system prompt shared by every request, a 64-token question, 64 tokens of answer."""
    random.seed(SEED)
    system = [random.randint(0, PROMPT_ID_RANGE) for _ in range(args.prefix_len)]
    prompts = [
        system + [random.randint(0, PROMPT_ID_RANGE) for _ in range(PREFIX_QUESTION_LEN)] for _ in range(args.num_seqs)
    ]
    params = SamplingParams(temperature=RANDOM_TEMPERATURE, ignore_eos=True, max_tokens=PREFIX_ANSWER_LEN)
    rows = []
    # caching off (no block is shared, so no cascade either), on, and on with cascade attention where the engine has it
    cascade_of = llm.extensions.get("cascade")  # the engine's cascade attention (ext/cascade.py), if it has one
    runs = [("off", False), ("on", False)] + [("on", True)] * (cascade_of is not None)
    for caching, cascade in runs:
        name = f"prefix caching {caching}" + (", cascade attention" if cascade else "")
        print(f"running nanoserve, {name}: {args.num_seqs} requests", flush=True)
        llm.block_manager.enable_prefix_caching = caching == "on"
        if cascade_of is not None:
            cascade_of.enabled = cascade
        reset_counters(llm)
        outs, seconds = timed_generate(llm, prompts, params)
        rows.append(result_row(name, llm, outs, seconds))
    for row in rows[1:]:
        print(f"{row['run']}: speed-up over caching off (wall time): {rows[0]['seconds'] / row['seconds']:.1f}x")
    return rows


def run_loras(llm, workload, args):
    """The workload with no adapter, then the same requests spread round-robin over args.loras random rank-16 adapters
    on q/k/v/o (example.py's save_random_adapter), in one engine with LoRA on; each run LORA_REPEATS times,
    alternating, the faster kept. Prefix caching is off: an adapter's blocks are its own, which would make the two
    runs' cache hits differ (the system prompts of the chat workload) and hide what the adapters' matmuls cost."""
    from example import save_random_adapter
    from nanoserve.ext.lora import LoRARequest
    from nanoserve.loader import resolve_model_dir

    folder = Path(tempfile.mkdtemp(prefix="nanoserve-loras-"))
    adapters = []
    for i in range(args.loras):
        save_random_adapter(resolve_model_dir(llm.config.model), folder / f"adapter-{i}", LORA_RANK, seed=i)
        adapters.append(LoRARequest(f"adapter-{i}", i + 1, str(folder / f"adapter-{i}")))
    spread = [adapters[i % len(adapters)] for i in range(len(workload.prompts))]
    llm.block_manager.enable_prefix_caching = False
    best = {}
    try:
        for _ in range(LORA_REPEATS):
            for name, lora_request in (("no adapter", None), (f"{args.loras} adapters", spread)):
                print(f"running nanoserve, LoRA on, {name}: {workload.description}", flush=True)
                reset_counters(llm)
                outs, seconds = timed_generate(llm, workload.prompts, workload.params, lora_request)
                if name not in best or seconds < best[name]["seconds"]:
                    best[name] = result_row(name, llm, outs, seconds)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rows = list(best.values())
    rows[1]["lora_slowdown"] = round(rows[1]["seconds"] / rows[0]["seconds"], 3)
    print(f"{args.loras} adapters / no adapter, wall time: {rows[1]['lora_slowdown']:.3f}x")
    return rows


def run_latency(llm, workload, args):
    """One request alone: 512-token prompt, 256 new greedy tokens; decode rate excludes the first token."""
    print(f"running nanoserve: 1 request, {LATENCY_PROMPT_LEN} prompt + {LATENCY_NEW_TOKENS} tokens", flush=True)
    random.seed(SEED)
    prompt = [[random.randint(0, PROMPT_ID_RANGE) for _ in range(LATENCY_PROMPT_LEN)]]
    greedy = {"temperature": 0, "ignore_eos": True}
    llm.block_manager.enable_prefix_caching = False  # both runs compute the prompt, no cache hit
    _, t_first = timed_generate(llm, prompt, SamplingParams(max_tokens=1, **greedy))
    reset_counters(llm)
    outs, t_all = timed_generate(llm, prompt, SamplingParams(max_tokens=LATENCY_NEW_TOKENS, **greedy))
    row = result_row("latency (1 request)", llm, outs, t_all)
    row["decode_tok_per_s"] = round((LATENCY_NEW_TOKENS - 1) / (t_all - t_first), 1)
    row["first_token_ms"] = round(t_first * 1000, 1)
    return [row]


def run_cpu_profile(llm, workload, args):
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

    for obj, stage, name in (
        (sched, "schedule", "schedule"),
        (runner, "prepare", "prepare"),
        (runner, "launch", "launch"),
        (llm, "finish", "_read_back"),
    ):
        setattr(obj, name, timed(stage, getattr(obj, name)))
    wait = InFlightStep.wait
    InFlightStep.wait = lambda self: timed("wait", wait)(self)
    try:
        rows = run_throughput(llm, workload, args)
    finally:
        InFlightStep.wait = wait
    for step in steps:
        step["launch"] = step.get("launch", 0.0) - step.get("prepare", 0.0)  # launch calls prepare
        step["finish"] = step.get("finish", 0.0) - step.get("wait", 0.0)  # _read_back calls wait
    for name, chosen in (("all", steps), ("decode-only", [s for s in steps if s["decode_only"]])):
        rows[0][f"{name}_steps"] = len(chosen)
        for stage in stages:
            ms = 1000 * sum(s.get(stage, 0.0) for s in chosen) / max(len(chosen), 1)
            rows[0][f"{name}_{stage}_ms"] = round(ms, 3)
    return rows


def run_serve(llm, workload, args):
    """The workload's requests sent to the OpenAI-compatible server in this process at Poisson arrival times."""
    import httpx

    from bench_serve import run_serve_bench
    from nanoserve.ext.server.app import serve_in_background

    print(f"running nanoserve's server: {workload.description}, {args.request_rate:g} requests/s", flush=True)
    requests = [(ids, len(ids), p.max_tokens) for ids, p in zip(workload.prompts, workload.params, strict=False)]
    with serve_in_background(llm) as base_url:
        model_name = httpx.get(f"{base_url}/models").json()["data"][0]["id"]
        row = run_serve_bench(base_url, requests, args.request_rate, model_name, SEED)
    return [row | {"threads": torch.get_num_threads()}]


def kv_report(trace_lines, max_model_len: int, block_size: int) -> dict:
    """vLLM's KV-memory claims on a step trace (trace.py's JSON lines, as strings or dicts): at the step with the
    most blocks in use (of equals, the one holding most tokens), the share of reserved KV memory wasted if every
    running request had reserved max_model_len contiguously (static batching), and the paged cache's waste (the
    unused slots of each sequence's last block)."""
    steps = [json.loads(line) if isinstance(line, str) else line for line in trace_lines]
    peak = max(steps, key=lambda s: (s["blocks"]["used"], s["kv_tokens"]))
    return {
        "kv_peak_step": peak["step"],
        "kv_peak_running": peak["running"],
        "kv_peak_blocks": peak["blocks"]["used"],
        "kv_static_waste": round(1 - peak["kv_tokens"] / (max(peak["running"], 1) * max_model_len), 4),
        "kv_paged_waste": round(peak["kv_unused_slots"] / (max(peak["blocks"]["used"], 1) * block_size), 4),
    }


def report_kv(row, trace_path, llm, workload):
    with open(trace_path) as f:
        report = kv_report(f, llm.config.max_model_len, llm.config.kvcache_block_size)
    saved = llm.stats()["prefix_hit_tokens"]
    report.update(prefix_saved_tokens=saved, prefix_saved_share=round(saved / max(workload.prompt_tokens, 1), 4))
    runner = llm.runner
    report.update(
        kv_cache_dtype=str(runner.kv_dtype).removeprefix("torch."),
        kv_bytes_per_token=runner.kv_bytes_per_token,
        kv_pool_tokens=runner.num_kvcache_blocks * llm.config.kvcache_block_size,
    )
    row.update(report)
    print(runner.kv_account())
    print(
        f"KV memory wasted at the peak step ({report['kv_peak_running']} running, {report['kv_peak_blocks']} blocks "
        f"of {llm.config.kvcache_block_size}): {report['kv_static_waste']:.1%} if each had reserved max_model_len="
        f"{llm.config.max_model_len} contiguously, {report['kv_paged_waste']:.1%} paged ({VLLM_CLAIMS})"
    )
    print(
        f"prefill saved by the prefix cache: {saved:,} of {workload.prompt_tokens:,} prompt tokens "
        f"({report['prefix_saved_share']:.1%})"
    )


def run_traced(llm, run, workload, args):
    """run under the engine's step trace (trace.py), attached after the warm-up so that its steps stay out; then the
    KV report and the plots from that trace."""
    from nanoserve.ext.plots import StepTrace

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.jsonl")
        llm.trace = StepTrace(path, llm)
        try:
            rows = run(llm, workload, args)
        finally:
            llm.trace.close()
            llm.trace = None
        if args.kv_report:
            report_kv(rows[0], path, llm, workload)
        if args.plot:
            from nanoserve.ext.plots import plot_trace  # main checked that it exists

            for png in plot_trace(path, args.plot):
                print(f"plot: {png}")
    return rows


# ---- transformers, the peer ------------------------------------------------------------------------------------
def hf_model(model_dir, dtype_name="auto", **kwargs):
    """transformers' model in the dtype nanoserve serves in: "auto" is bf16 on a GPU and fp32 on a CPU, as ours."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if dtype_name != "auto":
        dtype = getattr(torch, dtype_name)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kwargs).to(device).eval(), device


def hf_sampling(p: SamplingParams) -> dict:
    return {"do_sample": True, "temperature": p.temperature, "top_k": 0} if p.temperature > 0 else {"do_sample": False}


def peer_row(name, requests, tokens, seconds) -> dict:
    return {
        "run": name,
        "requests": requests,
        "output_tokens": tokens,
        "seconds": round(seconds, 2),
        "tok_per_s": round(tokens / seconds, 1),
        "threads": torch.get_num_threads(),
    }


def run_compare_hf(model_dir, workload, dtype_name="auto"):
    """The same requests through transformers' continuous batching (paged attention over SDPA, prefix sharing off):
    `generate_batch`'s own loop written out, as it takes one max_new_tokens for all requests. Left to itself it sizes
    its cache (and SDPA's batch x cache-tokens mask) from 60% of free memory, host RAM on a CPU (8 GB for 4 tiny
    requests): there it gets the pages the workload needs and a batch of all its prompts instead."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model, device = hf_model(model_dir, dtype_name, attn_implementation="paged|sdpa")
    prompts, params = workload.prompts, workload.params
    config = GenerationConfig(
        **hf_sampling(params[0]), max_new_tokens=max(p.max_tokens for p in params), eos_token_id=-1
    )
    hints = WorkloadHints(
        max_prompt_length=max(map(len, prompts)), max_generated_length=config.max_new_tokens, num_requests=len(prompts)
    )  # what generate_batch sizes its cache from
    sizes = {}
    if device == "cpu":
        pages = sum(-(-(len(ids) + p.max_tokens) // HF_PAGE_SIZE) for ids, p in zip(prompts, params, strict=False))
        sizes = {"num_blocks": pages, "max_batch_tokens": min(HF_MAX_BATCH_TOKENS, workload.prompt_tokens)}
    manager = model.init_continuous_batching(
        generation_config=config,
        workload_hints=hints,
        continuous_batching_config=ContinuousBatchingConfig(allow_block_sharing=False, **sizes),
    )
    manager.warmup()  # its CUDA-graph capture, outside the timed run as ours is
    manager.start()
    start = time.perf_counter()
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=False)):
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
    return peer_row("transformers continuous batching", len(prompts), tokens, seconds)


def run_compare_hf_sequential(model_dir, workload, dtype_name="auto"):
    """The same requests through transformers' generate one prompt at a time (batch 1, no padding), greedy or at the
    workload's temperature, with min_new_tokens = max_new_tokens so that it makes as many tokens as nanoserve."""
    from transformers import GenerationConfig

    model, device = hf_model(model_dir, dtype_name)
    eos = model.generation_config.eos_token_id
    pad = (eos[0] if isinstance(eos, list) else eos) or 0

    def generate(prompt, p):
        ids = torch.tensor([prompt], device=device)
        config = GenerationConfig(
            **hf_sampling(p),
            max_new_tokens=p.max_tokens,
            min_new_tokens=p.max_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
        )
        with torch.inference_mode():
            return (
                model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config).shape[1]
                - ids.shape[1]
            )

    generate(workload.prompts[0], replace(workload.params[0], max_tokens=WARMUP_TOKENS))  # warm-up
    start = time.perf_counter()
    tokens = sum(generate(prompt, p) for prompt, p in zip(workload.prompts, workload.params, strict=False))
    return peer_row("transformers one-at-a-time", len(workload.prompts), tokens, time.perf_counter() - start)


COMPARE = {
    "hf": (run_compare_hf, "transformers"),
    "hf-sequential": (run_compare_hf_sequential, "transformers one-at-a-time"),
}


# ---- the command line ------------------------------------------------------------------------------------------
@contextmanager
def busy_processes(count: int):
    """count processes burning a core each, the background load of a shared machine; killed on leaving."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(BUSY_START_S if procs else 0)
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def speculative_config(args) -> dict | None:
    """--speculative ngram or draft:DIR as vLLM's speculative_config (None without the flag)."""
    if args.speculative is None:
        return None
    if args.speculative == "ngram":
        return {"method": "ngram", "num_speculative_tokens": SPECULATIVE_TOKENS, "prompt_lookup_max": PROMPT_LOOKUP_MAX}
    method, _, draft_dir = args.speculative.partition(":")
    if method != "draft" or not draft_dir:
        raise SystemExit(f"--speculative {args.speculative!r}: expected ngram or draft:DIR")
    return {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": SPECULATIVE_TOKENS}


def run_engine(args, model_dir, cpu_default, speculative=None, latency_kernels=False):
    """nanoserve's run of the chosen mode (with speculative, vLLM's speculative_config; latency_kernels: batch 1's
    launch-latency kernels, ext/latency): (rows, the workload for a peer)."""
    llm = LLM(
        model_dir,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs or min(args.num_seqs, MAX_NUM_SEQS),
        speculative_config=speculative,
        latency_kernels=latency_kernels,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tp,
        threads=args.threads,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        overlap=args.overlap,
        lora_config={"max_loras": args.loras, "max_lora_rank": LORA_RANK} if args.loras else None,
        # --prefix measures cascade attention beside plain caching, where the extension is installed
        cascade_attention=bool(args.prefix and ext.find("cascade")),
    )
    try:
        workload = None if args.prefix or args.latency else build_workload(args, llm)
        if cpu_default:
            print(
                f"no GPU: the CPU workload, {workload.description} on the default model; --arch qwen3-0.6b "
                f"--num-seqs {STANDARD_NUM_SEQS} --max-output-len {STANDARD_MAX_LEN} for the standard GPU workload"
            )
        model = "the default model" if args.model == "default" else args.model or f"{args.arch}, random weights"
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        what = workload.description if workload else "the mode's own requests"
        print(
            f"bench: {device}, {model}, {what}, threads {torch.get_num_threads()}, tp {args.tp}, busy {args.busy}",
            flush=True,
        )
        llm.generate([[1, 2, 3]] * WARMUP_PROMPTS, SamplingParams(max_tokens=WARMUP_TOKENS), use_tqdm=False)
        run = (
            run_prefix
            if args.prefix
            else run_latency
            if args.latency
            else run_cpu_profile
            if args.cpu_profile
            else run_op_profile
            if args.op_profile
            else run_serve
            if args.serve
            else run_loras
            if args.loras
            else run_throughput
        )
        rows = run_traced(llm, run, workload, args) if args.kv_report or args.plot else run(llm, workload, args)
        extra = {"device": device, "busy": args.busy, "peak_rss_mb": peak_rss_mb()}
        if args.speculative:
            extra = {"speculative": "off" if speculative is None else args.speculative} | extra
        if args.latency_kernels:
            extra = {"latency_kernels": latency_kernels} | extra
        return [row | extra for row in rows], workload
    finally:
        llm.close()


def run_all(args, cpu_default):
    model_dir, temporary = model_dir_of(args)
    try:
        if args.speculative:
            name = f"speculative decoding ({args.speculative})"
            return run_beside(args, model_dir, cpu_default, name, speculative=speculative_config(args))
        if args.latency_kernels:
            rows = run_beside(args, model_dir, cpu_default, "latency kernels", latency_kernels=True)
            if args.latency:  # (the dependent launches work at 1-16 rows: the standard workload's tail only)
                rows += without_dependent_launch(args, model_dir, cpu_default, rows[-1])
            return rows
        rows, workload = run_engine(args, model_dir, cpu_default)
        if args.compare:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            torch.set_num_threads(args.threads or DEFAULT_THREADS)  # the peer as a user runs it
            run, name = COMPARE[args.compare]
            print(f"running {name}: {workload.description}", flush=True)
            rows.append(run(model_dir, workload, args.dtype) | {"busy": args.busy, "peak_rss_mb": peak_rss_mb()})
            ratio = rows[0]["tok_per_s"] / rows[-1]["tok_per_s"]
            rows[-1]["nanoserve_speedup"] = round(ratio, 2)
            print(f"nanoserve / {name}: {ratio:.1f}x")
        return rows
    finally:
        if temporary:
            shutil.rmtree(model_dir, ignore_errors=True)


def run_beside(args, model_dir, cpu_default, name, **option):
    """The mode's run without an option, then with it (each its own engine, the same requests; option: run_engine's
    speculative= or latency_kernels=), and the ratio of decode (or output) tok/s. Greedy outputs are the same tokens
    either way for speculative decoding (it is exact); the latency kernels may round a near-tie differently in bf16
    (their sums run in another order)."""
    plain, _ = run_engine(args, model_dir, cpu_default)
    other, _ = run_engine(args, model_dir, cpu_default, **option)
    rate = "decode_tok_per_s" if args.latency else "tok_per_s"
    ratio = other[0][rate] / plain[0][rate]
    other[0]["speedup"] = round(ratio, 2)
    print(f"{name} / without: {ratio:.2f}x {rate}")
    return plain + other


def dependent_launch_here() -> bool:
    """Whether this machine's GPU launches ext/latency's kernels as programmatic dependents (sm_90 and later)."""
    from nanoserve.ext.latency import gemv

    return torch.cuda.is_available() and gemv.dependent_launch(torch.device("cuda"))


def without_dependent_launch(args, model_dir, cpu_default, latency_row: dict) -> list[dict]:
    """Where the GPU has programmatic dependent launch, the latency kernels' run once more with it off (ext/latency's
    DEPENDENT_LAUNCH, for this engine only): what the dependent launches bring by themselves, as `dependent_speedup`
    on the latency kernels' row (its decode rate over this run's). Nothing elsewhere."""
    from nanoserve.ext.latency import gemv

    if not dependent_launch_here():
        return []
    gemv.DEPENDENT_LAUNCH = False
    try:
        rows, _ = run_engine(args, model_dir, cpu_default, latency_kernels=True)
    finally:
        gemv.DEPENDENT_LAUNCH = True
    rate = "decode_tok_per_s"
    rows[0]["latency_kernels"] = "without dependent launch"
    latency_row["dependent_speedup"] = round(latency_row[rate] / rows[0][rate], 3)
    print(f"latency kernels, dependent launches / without: {latency_row['dependent_speedup']:.3f}x {rate}")
    return rows


def peak_rss_mb() -> int:
    """This process's peak resident memory so far; TP workers are not in it. Linux: VmHWM, the peak of this process's
    own memory since it started. Not getrusage's ru_maxrss, which Linux carries across exec: a bench.py started by a
    5 GB pytest process reported the parent's 5 GB (the "flaky" peak of tests/test_bench.py::test_compare_hf).
    Elsewhere ru_maxrss (macOS counts bytes)."""
    import resource

    if os.path.exists("/proc/self/status"):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) >> 10 for line in f if line.startswith("VmHWM:"))  # in kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> (20 if sys.platform == "darwin" else 10)


def print_table(rows):
    columns = list(dict.fromkeys(k for row in rows for k in row))
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(str(row.get(c, "")).rjust(widths[c]) for c in columns))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        help="'default' (the embedded SmolLM2-135M-Instruct) or an HF directory "
        "(default: --arch with random weights; no GPU: 'default')",
    )
    ap.add_argument("--arch", choices=sorted(ARCHS), help="random-weight architecture (default qwen3-0.6b)")
    ap.add_argument(
        "--save-model", metavar="DIR", help="save --arch's random-weight model in DIR and exit (then pass --model DIR)"
    )
    ap.add_argument(
        "--dataset",
        choices=["random", "sharegpt", "chat", "repeat"],
        help="random ids (the standard workload), ShareGPT's lengths, ShareGPT chat prompts (the CPU workload), or "
        f"texts to repeat, correct or reformat ({REPEAT_NUM_SEQS} x {REPEAT_NEW_TOKENS} tokens: speculation's case)",
    )
    ap.add_argument(
        "--num-seqs",
        type=int,
        help=f"requests ({STANDARD_NUM_SEQS}; sharegpt {SHAREGPT_NUM_SEQS}; no GPU {CPU_NUM_SEQS})",
    )
    ap.add_argument("--max-input-len", type=int, default=STANDARD_MAX_LEN)
    ap.add_argument("--max-num-seqs", type=int, help="the batch: sequences per step (default: --num-seqs, at most 256)")
    ap.add_argument(
        "--speculative",
        metavar="ngram|draft:DIR",
        help=f"also run with speculative decoding ({SPECULATIVE_TOKENS} drafts per step): n-gram prompt lookup, or a "
        "draft model's folder; both runs are reported, with the speedup",
    )
    ap.add_argument(
        "--latency-kernels",
        action="store_true",
        help="also run with batch 1's launch-latency kernels (ext/latency: the few-row GEMV, the merged decode, "
        "dependent launches); both runs are reported, with the speedup (--latency on sm_90: a third without the "
        "dependent launches)",
    )
    ap.add_argument(
        "--max-output-len",
        type=int,
        help=f"({STANDARD_MAX_LEN}; sharegpt: the dataset's; chat or no GPU: {CPU_NEW_TOKENS})",
    )
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--prefix-len", type=int, default=2048, help="shared prompt length for --prefix")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="nanoserve's and the peer's dtype (auto: bf16 on a GPU, fp32 on a CPU)",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8"],
        help="the KV cache's element type: the model's (auto), or float8 e4m3 (fp8: 1 byte, twice bf16's tokens)",
    )
    ap.add_argument("--max-num-batched-tokens", type=int, help="the step's token budget (default: the engine's)")
    ap.add_argument(
        "--overlap", action=argparse.BooleanOptionalAction, help="host/GPU overlap (default: the engine's, per device)"
    )
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    ap.add_argument("--threads", type=int, help="CPU torch threads (default: the engine's, the free cores)")
    ap.add_argument("--busy", type=int, default=0, help="CPU-burning processes running beside the benchmark")
    ap.add_argument("--compare", choices=sorted(COMPARE), help="also run the requests through transformers")
    ap.add_argument("--kv-report", action="store_true", help="KV memory wasted (paged vs contiguous), prefill saved")
    ap.add_argument("--plot", metavar="DIR", help="write the run's step-trace plots here")
    ap.add_argument("--request-rate", type=float, default=math.inf, help="--serve: requests per second")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--prefix", action="store_true", help="shared 2k-token system prompt, caching on vs off")
    mode.add_argument("--latency", action="store_true", help="one request: 512 prompt, 256 new tokens")
    mode.add_argument("--cpu-profile", action="store_true", help="host ms per step by stage")
    mode.add_argument("--op-profile", action="store_true", help="torch.profiler: top operators by self CPU time")
    mode.add_argument("--attention", action="store_true", help="the attention kernels beside SDPA")
    mode.add_argument("--serve", action="store_true", help="the OpenAI server in-process, ShareGPT at --request-rate")
    mode.add_argument(
        "--loras",
        type=int,
        metavar="N",
        help="one engine with LoRA on: the requests with no adapter, then spread over N random rank-16 adapters",
    )
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    if (args.compare or args.kv_report or args.plot) and (args.prefix or args.latency or args.attention or args.serve):
        ap.error(
            "--compare, --kv-report and --plot go with the throughput modes, not --prefix/--latency/--attention/--serve"
        )
    if args.serve and args.dataset not in (None, "sharegpt"):
        ap.error("--serve sends ShareGPT requests")
    if args.speculative and (args.compare or args.prefix or args.attention or args.serve or args.tp > 1):
        ap.error("--speculative goes with the throughput and --latency modes, alone")
    if args.speculative and importlib.util.find_spec("nanoserve.ext.speculative") is None:
        ap.error("--speculative needs nanoserve/ext/speculative.py, which this checkout does not have")
    others = (args.speculative, args.compare, args.prefix, args.attention, args.serve, args.loras, args.kv_report)
    if args.latency_kernels and (any(others) or args.plot or args.tp > 1):
        ap.error("--latency-kernels goes with the throughput and --latency modes, alone")
    if args.latency_kernels and importlib.util.find_spec("nanoserve.ext.latency") is None:
        ap.error("--latency-kernels needs nanoserve/ext/latency, which this checkout does not have")
    if args.plot and importlib.util.find_spec("nanoserve.ext.plots") is None:
        ap.error("--plot needs nanoserve/ext/plots.py (plot_trace), which this checkout does not have")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.save_model:  # made once, then every run of a GPU check passes it as --model (15-40 s saved per run)
        save_random_model(args.arch or "qwen3-0.6b", args.save_model)
        print(f"saved a random {args.arch or 'qwen3-0.6b'} in {args.save_model}")
        return
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # the engine's KV-cache account
    logging.getLogger("httpx").setLevel(logging.WARNING)  # --serve: not a line per request
    if args.attention:
        from bench_attention import run_attention_bench

        rows = run_attention_bench()
    else:
        cpu_default = resolve_defaults(args, torch.cuda.is_available())
        with busy_processes(args.busy):
            rows = run_all(args, cpu_default)
    print_table(rows)
    print(json.dumps(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
