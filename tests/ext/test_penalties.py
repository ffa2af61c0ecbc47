"""repetition_penalty, presence_penalty, frequency_penalty and logit_bias (nanoserve/ext/penalties.py and the sampler):
greedy output must equal transformers' generate with the same rules as logits processors, token for token, in batches
that mix penalized and plain requests, with overlap on and off, under preemption, with n > 1, after an abort that
frees a row for the next request, with tensor parallelism, in both kernel backends, and on the default model.
Sampled runs with a seed are reproducible, and LLM(seed=...) is the seed of requests that set none."""

import math
from dataclasses import replace
from fractions import Fraction

import numpy as np
import pytest
import torch
from conftest import TRITON_DEVICE, default_model_or_skip, hf_generate, random_prompts, refused
from transformers import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from nanoserve import LLM, SamplingParams
from nanoserve.ext.chat import chat_prompts

ENGINE = {"device": "cpu", "max_model_len": 128, "num_kvcache_blocks": 32}
HUGE = 10**400  # too large for a float: float(HUGE) raises OverflowError
NUM_TOKENS = 12
# each kind alone, all at once (a boost below 1 and negative penalties too), and a plain request beside them
CASES = [
    {"repetition_penalty": 1.5},
    {"presence_penalty": 1.5, "frequency_penalty": 0.5},
    {"logit_bias": {5: 4.0, 17: -2.5, 100: 6.0}},
    {"repetition_penalty": 1.3, "presence_penalty": -0.5, "frequency_penalty": 1.0, "logit_bias": {7: 3.0}},
    {"repetition_penalty": 0.8, "frequency_penalty": -0.25},
    {},
]


class PresenceFrequency(LogitsProcessor):
    """OpenAI's rule: logit - presence x [count > 0] - frequency x count, counting the generated tokens only."""

    def __init__(self, num_prompt_tokens: int, presence: float, frequency: float):
        self.num_prompt_tokens, self.presence, self.frequency = num_prompt_tokens, presence, frequency

    def __call__(self, input_ids, scores):
        output = input_ids[:, self.num_prompt_tokens :]
        counts = torch.zeros_like(scores, dtype=torch.int32).scatter_add_(1, output, torch.ones_like(output).int())
        return scores - (self.frequency * counts + self.presence * (counts > 0))


class Bias(LogitsProcessor):
    def __init__(self, bias: dict[int, float]):
        self.bias = bias

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for token, bias in self.bias.items():
            scores[:, token] += bias
        return scores


def hf_penalized(hf, prompt: list[int], max_new_tokens: int, eos_token_id=None, **penalties) -> list[int]:
    """transformers' greedy tokens under the penalties, in vLLM's order: bias, repetition, frequency and presence.
    Repetition alone goes through generate's own repetition_penalty=."""
    kwargs = {}
    if set(penalties) == {"repetition_penalty"}:
        kwargs["repetition_penalty"] = penalties["repetition_penalty"]
    else:
        kwargs["logits_processor"] = LogitsProcessorList(
            [
                Bias(penalties.get("logit_bias", {})),
                RepetitionPenaltyLogitsProcessor(penalties.get("repetition_penalty", 1.0)),
                PresenceFrequency(
                    len(prompt), penalties.get("presence_penalty", 0.0), penalties.get("frequency_penalty", 0.0)
                ),
            ]
        )
    out = hf_generate(hf, prompt, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, **kwargs)
    return out[0, len(prompt) :].tolist()


def greedy(**penalties) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, **penalties)


def check_against_transformers(llm: LLM, hf, prompts: list[list[int]], cases: list[dict]) -> None:
    """One batch, prompt i under cases[i]: each output equals transformers', and no block stays in use."""
    outputs = llm.generate(prompts, [greedy(**case) for case in cases], use_tqdm=False)
    for prompt, case, out in zip(prompts, cases, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_penalized(hf, prompt, NUM_TOKENS, **case), case
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_penalties_equal_transformers(tiny_model, family, overlap):
    """Guards against any rule applied wrongly (a sign, prompt ids left out of repetition or counted in frequency,
    the order of bias and repetition), against counts that miss the pending token the overlapped step samples from,
    and against rows of a mixed batch mixed up (each request has its own penalties, one has none)."""
    path, hf = tiny_model(family)
    llm = LLM(path, overlap=overlap, **ENGINE)
    prompts = random_prompts([5, 9, 3, 12, 7, 6])
    prompts[0] = prompts[0] * 2  # a prompt that repeats itself: repetition penalizes its ids from the start
    check_against_transformers(llm, hf, prompts, CASES)


def test_preemption_rebuilds_the_counts(tiny_model):
    """Guards against a preempted sequence's counts lost or counted twice: recompute frees its row and fills a new
    one from its tokens on readmission. Six sequences that each outgrow one block of 16 in a pool of 5 blocks are
    preempted while they decode, and readmitted with their output so far."""
    path, hf = tiny_model("llama")
    llm = LLM(path, max_model_len=128, device="cpu", num_kvcache_blocks=5)
    prompts = random_prompts([13, 12, 14, 13, 12, 14])
    check_against_transformers(llm, hf, prompts, CASES[:5] + CASES[:1])
    assert llm.stats()["preemptions"] > 0


def test_the_table_grows_with_the_sequences_that_use_it(tiny_model):
    """Guards against a table sized by max_num_seqs (65,536 rows of the vocabulary: 300 MB for the tiny model, 38 GB
    for SmolLM2's, a MemoryError past that) and against counts lost when it grows: it starts with 4 rows and doubles
    when a fifth sequence comes while four decode, whose counts (bumped on the device by each step) are copied over;
    every output equals transformers'."""
    path, hf = tiny_model("llama")
    llm = LLM(path, max_num_seqs=65_536, **ENGINE)
    prompts = random_prompts([5, 9, 7, 6, 8, 11])
    cases = CASES[:5] + CASES[:1]
    for i in range(4):
        llm.add_request(prompts[i], greedy(**cases[i]), f"r{i}")
    outputs = {}
    for _ in range(4):  # the first four decode a few tokens
        outputs |= {out.request_id: out for out in llm.step() if out.finished}
    assert len(llm.logits_processors["penalties"].table) == 4
    for i in (4, 5):
        llm.add_request(prompts[i], greedy(**cases[i]), f"r{i}")
    while llm.has_unfinished_requests():
        outputs |= {out.request_id: out for out in llm.step() if out.finished}
    assert len(llm.logits_processors["penalties"].table) == 8
    for i, (prompt, case) in enumerate(zip(prompts, cases, strict=True)):
        assert outputs[f"r{i}"].outputs[0].token_ids == hf_penalized(hf, prompt, NUM_TOKENS, **case), case


def test_n_samples_and_a_reused_row(tiny_model):
    """Guards against n samples sharing one row of counts, and against a row freed by an abort keeping its counts
    for the next sequence that takes it (max_num_seqs=2: two rows, taken in turn)."""
    path, hf = tiny_model("qwen2")
    llm = LLM(path, max_num_seqs=2, **ENGINE)
    prompt = random_prompts([8])[0]
    case = CASES[3]
    request_id = llm.add_request(prompt, greedy(n=2, **case))
    for _ in range(5):
        llm.step()
    llm.abort(request_id)
    outputs = llm.generate(prompt, greedy(n=2, **case), use_tqdm=False)[0].outputs
    expected = hf_penalized(hf, prompt, NUM_TOKENS, **case)
    assert [o.token_ids for o in outputs] == [expected, expected]
    assert len(llm.logits_processors["penalties"].row_of) <= 2 and llm.stats()["kv_blocks_used"] == 0


def test_triton_sampler_in_the_interpreter(tiny_model):
    """Guards against the Triton backend (its sampling kernel) drawing from logits other than the penalized ones."""
    path, hf = tiny_model("qwen3")
    llm = LLM(path, **ENGINE | {"kernels": "triton", "device": TRITON_DEVICE, "dtype": "float32"})
    check_against_transformers(llm, hf, random_prompts([6]), [CASES[3]])


def test_two_ranks(tiny_model):
    """Guards against penalties that only rank 0 applies breaking tensor parallelism (rank 0 samples; the workers
    take its tokens): two ranks over gloo equal transformers."""
    path, hf = tiny_model("llama")
    llm = LLM(path, tensor_parallel_size=2, **ENGINE)
    check_against_transformers(llm, hf, random_prompts([6, 9]), [CASES[3], CASES[1]])
    llm.close()


def test_default_model_chat(tmp_path):
    """Guards against the penalties on a real vocabulary of 49,152 ids and a real chat prompt: SmolLM2's greedy
    answer with a repetition penalty, and with presence, frequency and a bias against <|im_end|>, equals
    transformers', stopping at the same <|im_end|> if any."""
    import transformers

    model_dir = default_model_or_skip()
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(model_dir, device="cpu", max_model_len=256, num_kvcache_blocks=32)
    prompt = chat_prompts(llm, [{"role": "user", "content": "List three fruits, then three more."}])[0]
    im_end = llm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    cases = [
        {"repetition_penalty": 1.3},
        {"logit_bias": {im_end: -5.0}, "presence_penalty": 0.5, "frequency_penalty": 0.3},
    ]
    params = [SamplingParams(temperature=0, max_tokens=12, **case) for case in cases]
    outputs = llm.generate([prompt] * 2, params, use_tqdm=False)
    for case, out in zip(cases, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_penalized(hf, prompt, 12, eos_token_id=im_end, **case), case


def test_seeded_sampling_is_reproducible_and_llm_seed_is_the_default(tiny_model):
    """Guards against penalized sampling that depends on anything but the seed (a row's leftover counts, the batch),
    and against LLM(seed=...) not reaching requests without a seed (or overriding those with one)."""
    path, _ = tiny_model("llama")
    prompt = random_prompts([7])[0]
    sampled = SamplingParams(temperature=1.0, max_tokens=NUM_TOKENS, ignore_eos=True, **CASES[3])
    llm = LLM(path, **ENGINE)
    seeded = replace(sampled, seed=1234)
    first = llm.generate([prompt, prompt], [seeded, sampled], use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert first == again
    default_seeded = LLM(path, seed=1234, **ENGINE)
    assert default_seeded.generate(prompt, sampled, use_tqdm=False)[0].outputs[0].token_ids == first
    other = replace(sampled, seed=99)
    assert default_seeded.generate(prompt, other, use_tqdm=False)[0].outputs[0].token_ids == (
        llm.generate(prompt, other, use_tqdm=False)[0].outputs[0].token_ids
    )


# ---- bad values ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"repetition_penalty": 0}, "repetition_penalty"),  # > 0: dividing by 0
        ({"repetition_penalty": -1.5}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"repetition_penalty": math.nan}, "repetition_penalty"),
        ({"repetition_penalty": True}, "repetition_penalty"),  # a bool is not a number here
        ({"repetition_penalty": "1.1"}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": Fraction(-201, 100)}, "presence_penalty"),
        ({"presence_penalty": None}, "presence_penalty"),
        ({"frequency_penalty": -HUGE}, "frequency_penalty"),
        ({"frequency_penalty": np.bool_(True)}, "frequency_penalty"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),  # OpenAI's JSON has string keys; the Python API takes ids
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {5: -HUGE}}, "logit_bias"),
        ({"logit_bias": {5: math.nan}}, "logit_bias"),
        ({"logit_bias": {5: True}}, "logit_bias"),
        ({"logit_bias": {True: 1.0}}, "logit_bias"),
        ({"logit_bias": [(5, 1.0)]}, "logit_bias"),
        ({"logit_bias": 0}, "logit_bias"),
    ],
    ids=str,
)
def test_bad_penalties_and_bias_name_the_field(kwargs, field):
    """Guards against penalties out of their ranges (repetition > 0, presence and frequency in [-2, 2], biases in
    [-100, 100]), or of the wrong type (a bool or a string where a number is expected, string token ids), being
    taken."""
    refused(field, SamplingParams, **kwargs)


def test_penalty_values_are_stored_as_python_numbers_and_bias_ids_checked(tiny_model):
    """Guards against numpy or Fraction penalties reaching the sampler as such, and logit_bias ids outside the
    vocabulary (which would index past the logits) being queued; the engine serves afterwards."""
    llm = LLM(tiny_model("llama")[0], device="cpu", max_model_len=64, num_kvcache_blocks=16, max_num_seqs=4)
    params = SamplingParams(
        repetition_penalty=np.float32(1.5),
        presence_penalty=Fraction(1, 2),
        frequency_penalty=np.int64(-2),
        logit_bias={np.int64(5): np.float16(-1.5), 7: Fraction(3, 2), 9: 100},
    )
    assert [type(v) for v in (params.repetition_penalty, params.presence_penalty, params.frequency_penalty)] == [
        float
    ] * 3
    assert params.logit_bias == {5: -1.5, 7: 1.5, 9: 100.0} and all(type(t) is int for t in params.logit_bias)
    assert all(type(b) is float for b in params.logit_bias.values())
    prompt = random_prompts([5])[0]
    for bias in ({384: 1.0}, {-1: 1.0}, {5: 1.0, 10**30: 2.0}):
        refused("logit_bias", llm.generate, prompt, SamplingParams(logit_bias=bias), use_tqdm=False)
    assert not llm.has_unfinished_requests() and llm.stats()["kv_blocks_used"] == 0  # nothing queued, nothing held
    assert len(llm.generate(prompt, SamplingParams(logit_bias={5: 1.0}, max_tokens=4), use_tqdm=False)) == 1
