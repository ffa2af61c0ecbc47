"""Chat with the embedded default model (SmolLM2-135M-Instruct) or any HF model: python example.py [--model DIR]."""
import argparse
import logging
import time

from nanoserve import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 10.",
]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF directory (default: the embedded SmolLM2)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # shows the KV cache account

    llm = LLM(args.model, max_model_len=2048)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    start = time.perf_counter()
    outputs = llm.chat(conversations, SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens))
    seconds = time.perf_counter() - start
    for question, out in zip(QUESTIONS, outputs):
        answer = out.outputs[0]
        print(f"\n> {question}\n{answer.text.strip()}  [{len(answer.token_ids)} tokens, {answer.finish_reason}]")
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = llm.stats()
    print(f"\n{generated} tokens in {seconds:.2f} s: {generated / seconds:.1f} tok/s "
          f"(batch of {len(outputs)}, {llm.config.device}); KV blocks at peak {stats['kv_blocks_peak']} of "
          f"{stats['kv_blocks_total']}; prefix-cache hit rate {stats['prefix_hit_rate']:.0%}; "
          f"preemptions {stats['preemptions']}")


if __name__ == "__main__":
    main()
