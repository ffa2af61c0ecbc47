"""Chat with the embedded default model (SmolLM2-135M-Instruct) or any HF model: python example.py [--model DIR].
The other options are the knobs of the course guide's experiments (docs/course.md); --plot DIR also writes a step
trace and draws it (kv_blocks.png, batches.png, block_tables.png; needs matplotlib). --beam-width N runs a beam search
of N beams on each question instead of chatting (LLM.beam_search), and compares the KV blocks it used with what
beams that did not share their blocks would need. --speculative K proposes K n-gram draft tokens per step (speculative
decoding), and --repeat asks for answers that copy their input, where the drafts are right. --loras N makes N random
LoRA adapters for the model and asks the first N questions each under its own adapter (the others under none), in one
batch, and prints the slot table."""

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from nanoserve import LLM, SamplingParams
from nanoserve.ext.chat import chat_prompts
from nanoserve.sampling_params import BeamSearchParams

if TYPE_CHECKING:  # --beam-width's outputs; the extension itself is loaded by LLM.beam_search
    from nanoserve.ext.beam_search import BeamSearchOutput

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 10.",
]
SYSTEM_PROMPT = (  # about 120 tokens, the same at the start of every conversation with --system-prompt
    "You are a friendly and patient teaching assistant for a university course on how large language models are "
    "served. Students ask you short questions about science, writing, mathematics and geography while they wait "
    "for their experiments to finish. Answer in plain English, keep every answer short and correct, prefer simple "
    "words to technical terms, and never invent facts: when you do not know something, say so. If a question asks "
    "for a list, give exactly the number of items requested. If it asks for a poem, respect its form. Do not "
    "mention these instructions, and do not greet the student: answer the question directly."
)

REPEAT_TASKS = [  # --repeat: four answers that copy the system prompt's text, each in its own way
    "Repeat the following text exactly, word for word.",
    "Correct any spelling or grammar mistakes in the following text, and write out the whole corrected text.",
    "Rewrite the following text with each sentence on a line of its own, keeping every word.",
    "Copy the following text, then stop.",
]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF directory (default: the embedded SmolLM2)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (a power of two, 16-256)")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (small: preemptions)")
    parser.add_argument(
        "--max-batched-tokens",
        type=int,
        default=None,
        help="token budget of one step (default: 8192 on a GPU, 512 on a CPU)",
    )
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument(
        "--kv-offloading-size",
        type=float,
        default=None,
        metavar="GIB",
        help="a host-memory tier of GIB behind the prefix cache: evicted blocks copied there, and back (swap)",
    )
    parser.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="launch step n+1 before reading step n back (default: on with a GPU, off on a CPU)",
    )
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="fp8: 1 byte per K/V element")
    parser.add_argument(
        "--system-prompt",
        nargs="?",
        const=SYSTEM_PROMPT,
        default=None,
        metavar="TEXT",
        help="start every conversation with this system prompt (a built-in one if TEXT is left out)",
    )
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: fp32 on a CPU (equal to transformers), the checkpoint's 16-bit type on a GPU; bfloat16 on a CPU "
        "with native bf16 (AVX512-BF16, AMX, Arm BF16) is faster (see README)",
    )
    parser.add_argument(
        "--beam-width",
        type=int,
        default=None,
        metavar="N",
        help="beam search with N beams per question instead of chat generation (deterministic: no --temperature)",
    )
    parser.add_argument(
        "--speculative",
        type=int,
        default=None,
        metavar="K",
        help="speculative decoding: up to K draft tokens per step from n-gram lookup in the prompt and answer so far",
    )
    parser.add_argument(
        "--repeat",
        action="store_true",
        help="instead of the four questions, ask four times for the built-in text back (repeated, corrected, one "
        "sentence per line, copied): answers that reuse their input, speculative decoding's best case",
    )
    parser.add_argument(
        "--loras",
        type=int,
        default=None,
        metavar="N",
        help="N random LoRA adapters (rank 4, 8, 16, ... on q/k/v/o), one per question, in one batch (at most 3)",
    )
    parser.add_argument("--plot", metavar="DIR", help="write DIR/trace.jsonl and draw it into DIR as PNG files")
    return parser.parse_args(argv)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {
        "max_model_len": 2048,
        "kvcache_block_size": args.block_size,
        "num_kvcache_blocks": args.num_blocks,
        "max_num_batched_tokens": args.max_batched_tokens,
        "enable_prefix_caching": not args.no_prefix_caching,
        "kv_offloading_size": args.kv_offloading_size,  # ext/kv_offload.py
        "overlap": args.overlap,
        "kv_cache_dtype": args.kv_cache_dtype,
        "threads": args.threads,
        "dtype": args.dtype,
        "trace": str(Path(args.plot) / "trace.jsonl") if args.plot else None,
        "speculative_config": speculative_config(args.speculative),
        # --loras: a slot per adapter and a free one (ext/lora.py; vLLM's enable_lora=True, max_loras=... too)
        "lora_config": {"max_loras": args.loras + 1} if args.loras else None,
    }


def speculative_config(k: int | None) -> dict | None:
    """--speculative K as vLLM's speculative_config: n-gram prompt lookup of suffixes up to 4 tokens long."""
    if k is None:
        return None
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4}


def questions(args: argparse.Namespace) -> list[str]:
    """The four chat questions, or with --repeat the four requests to copy the built-in text."""
    if args.repeat:
        return [f"{task}\n\n{SYSTEM_PROMPT}" for task in REPEAT_TASKS]
    return QUESTIONS


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # shows the KV cache account
    if args.plot:
        Path(args.plot).mkdir(parents=True, exist_ok=True)
    llm = LLM(args.model, **engine_kwargs(args))
    system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    conversations = [system + [{"role": "user", "content": q}] for q in questions(args)]
    if args.beam_width:
        beam_search(llm, conversations, args)
    else:
        chat(llm, conversations, args, random_adapters(llm, args.loras) if args.loras else [])
    if args.plot:
        from nanoserve.ext.plots import plot_trace

        for path in plot_trace(llm.config.trace, args.plot):
            print(f"wrote {path}")


def slot_table(adapters: object) -> str:
    """ext/lora's slots as its step hook left them for the last step, a line each: the adapter in it (name and id, or
    free) and that step's rows in it (Adapters.slot_of: adapter -> slot, a free slot keyed by its own number;
    Adapters.last_rows: per slot, its rows)."""
    held = {
        slot: f"{r.lora_name} (id {r.lora_int_id})" for r, slot in adapters.slot_of.items() if not isinstance(r, int)
    }
    return "\n".join(
        f"slot {slot}: {held.get(slot, 'free'):<24} {len(rows):>4} rows {rows[:1] + rows[-1:]}"
        for slot, rows in enumerate(adapters.last_rows)
    )


def chat(llm: LLM, conversations: list[list[dict]], args: argparse.Namespace, adapters: list) -> None:
    """Generate an answer to every question in one batch, the first ones each under its own adapter of adapters
    (--loras: then the slot table of the batch's first step is printed, before the answers); print them, the
    throughput, the KV account, and the steps (with --speculative, what became of the drafts)."""
    before = llm.stats()
    start, computed = time.perf_counter(), before["computed_tokens"]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    per_question = adapters + [None] * (len(conversations) - len(adapters))
    tables = []  # the slot table after each step's hook (ext/lora.py's runs first)
    if adapters:
        llm.runner.step_hooks.append(lambda step: tables.append(slot_table(llm.extensions["lora"])))
    outputs = llm.chat(conversations, params, lora_request=per_question if adapters else None)
    seconds = time.perf_counter() - start
    if adapters:
        print(
            f"\nthe slot table of the first step (rows: the step's tokens, prompts one after the other):\n{tables[0]}"
        )
    for question, out, adapter in zip(questions(args), outputs, per_question, strict=False):
        answer = out.outputs[0]
        asked = question.splitlines()[0]  # --repeat: the task, not the text after it
        under = f" (adapter {adapter.lora_name})" if adapter else (" (no adapter)" if adapters else "")
        print(f"\n> {asked}{under}\n{answer.text.strip()}  [{len(answer.token_ids)} tokens, {answer.finish_reason}]")
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats, bs = llm.stats(), args.block_size
    prompt, cached = sum(len(o.prompt_token_ids) for o in outputs), sum(o.num_cached_tokens for o in outputs)
    print(
        f"\n{generated} tokens in {seconds:.2f} s: {generated / seconds:.1f} tok/s "
        f"(batch of {len(outputs)}, {llm.config.device}); KV blocks at peak {stats['kv_blocks_peak']} of "
        f"{stats['kv_blocks_total']}; prefix-cache hit rate {cached / prompt:.0%}; "
        f"preemptions {stats['preemptions']}"
    )
    lengths = [len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outputs]
    slots = sum(-(-n // bs) * bs for n in lengths)  # the slots of each request's blocks at its end
    print(
        f"KV at peak: {stats['kv_blocks_peak']} blocks x {bs} = {stats['kv_blocks_peak'] * bs} token slots; "
        f"requests at their end: {sum(lengths)} tokens in {slots} slots ({1 - sum(lengths) / slots:.0%} unused)"
    )
    ttft = sum(o.metrics.first_token_time - o.metrics.arrival_time for o in outputs) / len(outputs)
    print(
        f"prompts: {prompt} tokens, {cached} from the prefix cache; tokens computed "
        f"{stats['computed_tokens'] - computed}; time to first token {ttft:.2f} s (mean)"
    )
    steps = stats["steps"] - before["steps"]
    line = f"steps {steps}: {generated / steps:.2f} tokens per step"
    if "spec_proposed_tokens" in stats:  # speculative decoding: what became of the drafts
        line += (
            f"; drafts proposed {stats['spec_proposed_tokens']}, accepted {stats['spec_accepted_tokens']} "
            f"({stats['spec_acceptance_rate']:.0%}), mean accepted run {stats['spec_mean_accepted_length']:.2f}"
        )
    print(line)
    host_tier = llm.extensions.get("kv_offload")
    if host_tier is not None:  # --kv-offloading-size: blocks that left the device and came back
        tier = {name.removeprefix("kv_offload_"): n for name, n in host_tier.stats().items()}
        print(
            f"host tier: blocks saved {tier['blocks_saved']}, loaded back {tier['blocks_loaded']}, dropped "
            f"{tier['blocks_dropped']}; preempted sequences readmitted by swap {tier['preemptions_swapped']}, by "
            f"recompute {tier['preemptions_recomputed']}, from the device's cache {tier['preemptions_resumed']}"
        )


def random_adapters(llm: LLM, count: int) -> list:
    """count random LoRA adapters for llm's model, of ranks 4, 8, 16, ... on q/k/v/o, in a temporary folder (PEFT's
    format), as LoRARequests."""
    from nanoserve.ext.lora import LoRARequest
    from nanoserve.loader import resolve_model_dir

    folder = Path(tempfile.mkdtemp(prefix="nanoserve-loras-"))
    for i in range(count):
        save_random_adapter(resolve_model_dir(llm.config.model), folder / f"adapter-{i + 1}", 4 << i, seed=i)
    return [LoRARequest(f"adapter-{i + 1}", i + 1, str(folder / f"adapter-{i + 1}")) for i in range(count)]


def save_random_adapter(
    model_dir: str, folder: Path, rank: int, targets: tuple = ("q_proj", "k_proj", "v_proj", "o_proj"), seed: int = 0
) -> None:
    """A random LoRA adapter for the model in model_dir, in PEFT's format (adapter_config.json and
    adapter_model.safetensors), made without peft: A ~ N(0, 1/in) and B ~ N(0, 0.04^2) (twice the scale of SmolLM2's
    own weights: a projection's output moves by a tenth to a fifth), lora_alpha = rank (scale 1)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, inter, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, config.get("num_key_value_heads", heads) * head_dim
    shapes = {  # (in, out) features, and the module of the decoder layer
        "q_proj": (hidden, q, "self_attn"),
        "k_proj": (hidden, kv, "self_attn"),
        "v_proj": (hidden, kv, "self_attn"),
        "o_proj": (q, hidden, "self_attn"),
        "gate_proj": (hidden, inter, "mlp"),
        "up_proj": (hidden, inter, "mlp"),
        "down_proj": (inter, hidden, "mlp"),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for target in targets:
            n_in, n_out, module = shapes[target]
            name = f"base_model.model.model.layers.{layer}.{module}.{target}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, n_in, generator=generator) / n_in**0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(n_out, rank, generator=generator) * 0.04
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    peft_config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(targets)}
    (folder / "adapter_config.json").write_text(json.dumps(peft_config | {"base_model_name_or_path": str(model_dir)}))


def beam_search(llm: LLM, conversations: list[list[dict]], args: argparse.Namespace) -> None:
    """A beam search of args.beam_width beams on every question, one question after the other (LLM.beam_search);
    print each question's beams, best first, then the KV blocks the search used at its peak against what the same
    beams would need if each held its own copy of the prompt and of its history."""
    k, bs = args.beam_width, args.block_size
    prompts = chat_prompts(llm, conversations)
    before = llm.stats()
    start = time.perf_counter()
    outputs = llm.beam_search(prompts, BeamSearchParams(beam_width=k, max_tokens=args.max_tokens))
    seconds = time.perf_counter() - start
    unshared = []  # per question
    for question, prompt, out in zip(QUESTIONS, prompts, outputs, strict=True):
        print(f"\n> {question}")
        for rank, beam in enumerate(out.sequences):
            generated = len(beam.tokens) - len(prompt)
            print(
                f"  {rank}. score {beam.score:.3f}, cum_logprob {beam.cum_logprob:.3f}, {generated} tokens, "
                f"{beam.finish_reason}: {beam.text.strip()!r}"
            )
        unshared.append(unshared_blocks(out, bs))
    stats = llm.stats()
    cached = stats["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    print(
        f"\n{len(prompts)} questions x {k} beams in {seconds:.2f} s ({llm.config.device}); prompts: "
        f"{sum(map(len, prompts))} tokens, {cached} from the prefix cache; tokens computed "
        f"{stats['computed_tokens'] - before['computed_tokens']} (each prompt once, then one per beam and step)"
    )
    print(
        f"KV blocks at peak {stats['kv_blocks_peak']} of {stats['kv_blocks_total']} (beams sharing blocks); "
        f"unshared beams would need {max(unshared)} ({k} x their own copy of prompt and history; per question: "
        f"{', '.join(map(str, unshared))}); KV blocks in use after: {stats['kv_blocks_used']}"
    )


def unshared_blocks(out: "BeamSearchOutput", block_size: int) -> int:
    """The KV blocks a prompt's beams would hold in the search's last step if none shared any: each beam its own copy
    of the prompt and of its history, as long as the longest beam returned, less its last token (whose K/V is never
    computed: the search ends when it is chosen). A lower bound: a search that stopped early had running beams as
    long as that, or longer."""
    longest = max(len(beam.tokens) for beam in out.sequences)
    return len(out.sequences) * -(-(longest - 1) // block_size)


if __name__ == "__main__":
    main()
