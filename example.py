"""Chat with the embedded default model (SmolLM2-135M-Instruct) or any HF model: python example.py [--model DIR]."""
import argparse
import time

from nanoserve import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 10.",
]


def print_kv_account(llm: LLM):
    a, runner = llm.runner.args, llm.runner
    per_token = runner.kv_bytes_per_token
    blocks, block_size = runner.num_kvcache_blocks, llm.config.kvcache_block_size
    print(f"KV cache: 2 x {a.num_layers} layers x {a.num_kv_heads} kv heads x {a.head_dim} head_dim x "
          f"{runner.dtype.itemsize} bytes = {per_token / 1024:.1f} KiB per token")
    print(f"          {blocks} blocks x {block_size} tokens = {blocks * block_size:,} tokens "
          f"({blocks * block_size * per_token / 2**30:.2f} GiB) on {llm.config.device}")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF directory or hub id (default: embedded SmolLM2)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()

    llm = LLM(args.model, max_model_len=2048)
    print_kv_account(llm)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    start = time.perf_counter()
    outputs = llm.chat(conversations, SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens))
    seconds = time.perf_counter() - start
    for question, out in zip(QUESTIONS, outputs):
        print(f"\n> {question}\n{out.text.strip()}  [{len(out.token_ids)} tokens, {out.finish_reason}]")
    generated = sum(len(o.token_ids) for o in outputs)
    stats = llm.stats()
    print(f"\n{generated} tokens in {seconds:.2f} s: {generated / seconds:.1f} tok/s "
          f"(batch of {len(outputs)}, {llm.config.device}); prefix-cache hit rate "
          f"{stats['prefix_hit_rate']:.0%}, preemptions {stats['preemptions']}")


if __name__ == "__main__":
    main()
