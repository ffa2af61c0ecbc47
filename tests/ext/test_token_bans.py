"""allowed_token_ids and bad_words (nanoserve/ext/token_bans.py): greedy output must equal transformers' generate with
the same rules as its own logits processors (suppress_tokens for every id not allowed; bad_words_ids for the words, as
vLLM tokenizes them), in batches beside plain requests, with overlap on and off; bad input is refused by name."""

import pytest
import torch
from conftest import default_model_or_skip, hf_generate, random_prompts, refused

from nanoserve import LLM, SamplingParams
from nanoserve.ext.token_bans import bad_word_ids

ENGINE = {"device": "cpu", "max_model_len": 128, "num_kvcache_blocks": 32}
NUM_TOKENS = 10
VOCAB = 384  # the tiny models' (conftest.TINY)


def greedy(**bans: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, **bans)


@pytest.mark.parametrize("overlap", [False, True])
def test_allowed_token_ids_equal_transformers(tiny_model, overlap):
    """Guards against an allowed set that leaks (another id sampled), that masks the wrong row of a batch, or that
    stays on a plain request beside it: each output equals transformers' greedy with every other id suppressed."""
    path, hf = tiny_model("llama")
    llm = LLM(path, overlap=overlap, **ENGINE)
    prompts = random_prompts([7, 12, 9])
    torch.manual_seed(0)
    allowed = [sorted(torch.randperm(VOCAB)[:k].tolist()) for k in (5, 40)]
    params = [greedy(allowed_token_ids=allowed[0]), greedy(), greedy(allowed_token_ids=allowed[1])]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        suppress = [] if p.allowed_token_ids is None else sorted(set(range(VOCAB)) - set(p.allowed_token_ids))
        expected = hf_generate(hf, prompt, max_new_tokens=NUM_TOKENS, eos_token_id=None, suppress_tokens=suppress)
        assert out.outputs[0].token_ids == expected[0, len(prompt) :].tolist()
        if p.allowed_token_ids is not None:
            assert set(out.outputs[0].token_ids) <= set(p.allowed_token_ids)
    assert llm.stats()["kv_blocks_used"] == 0


def test_bad_words_are_tokenized_as_vllm_tokenizes_them():
    """Guards against a word caught only at the start of the text (or only after a space): vLLM's rule keeps the plain
    form and adds the spaced one where it starts with a different token and has as many tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_or_skip())

    def ids(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    assert bad_word_ids(tokenizer, ["Paris"]) == [ids("Paris"), ids(" Paris")]  # one token each, different
    assert bad_word_ids(tokenizer, ["  Paris"]) == [ids("Paris"), ids(" Paris")]  # leading whitespace is stripped
    # " Berlin" is one token, "Berlin" two: the spaced form has fewer tokens, so vLLM keeps the plain one only
    assert bad_word_ids(tokenizer, ["Berlin"]) == [ids("Berlin")] and len(ids(" Berlin")) == 1
    for word in ("New York", "unbelievably"):
        plain, spaced = ids(word), ids(" " + word)
        expected = [plain, spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [plain]
        assert bad_word_ids(tokenizer, [word]) == expected and len(plain) > 1


@pytest.fixture(scope="module")
def default_llm():
    """The default model, ours and transformers' (fp32), with its tokenizer."""
    import transformers

    model_dir = default_model_or_skip()
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return LLM(model_dir, device="cpu", max_model_len=256, num_kvcache_blocks=32), hf


PROMPT = "The capital of France is Paris. The capital of Germany is"  # greedy: " Berlin. The capital of the ..."


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("words, lengths", [(["The"], {1}), (["capital of"], {2})])
def test_bad_words_equal_transformers(default_llm, overlap, words, lengths):
    """Guards against a bad word still generated (its one token; or its last token after the ones before it), against
    a ban on a token that only ends a word elsewhere, and against a stale ban with overlapped steps (a word of several
    tokens needs the newest token's value): the output equals transformers' greedy with the same words as
    bad_words_ids, and differs from the output without them, so the bans were exercised."""
    llm, hf = default_llm
    llm.config.overlap = overlap  # read at every step
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode(PROMPT)
    word_ids = bad_word_ids(tokenizer, words)
    assert {len(w) for w in word_ids} == lengths, word_ids
    # transformers matches a word's prefix against the prompt too; vLLM's rule reads the output only: this prompt
    # ends with no prefix, so the two rules agree
    assert not any(len(w) > 1 and tuple(prompt[-len(w) + 1 :]) == w[:-1] for w in word_ids)
    plain = llm.generate(prompt, greedy(), use_tqdm=False)[0].outputs[0].token_ids
    banned = llm.generate(prompt, greedy(bad_words=words), use_tqdm=False)[0].outputs[0].token_ids
    expected = hf_generate(
        hf, prompt, max_new_tokens=NUM_TOKENS, eos_token_id=None, bad_words_ids=[list(w) for w in word_ids]
    )
    assert banned == expected[0, len(prompt) :].tolist() and banned != plain
    assert llm.stats()["kv_blocks_used"] == 0


def test_bad_words_and_plain_requests_in_one_batch(default_llm):
    """Guards against a word's ban reaching a plain request batched beside it, or n samples sharing a matcher."""
    llm, _ = default_llm
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode("Once upon a time")
    plain = llm.generate(prompt, greedy(), use_tqdm=False)[0].outputs[0].token_ids
    word = tokenizer.decode(plain[:1]).strip()
    outs = llm.generate([prompt, prompt], [greedy(bad_words=[word], n=2), greedy()], use_tqdm=False)
    banned = {t for w in bad_word_ids(tokenizer, [word]) for t in w}
    assert all(not banned & set(s.token_ids) for s in outs[0].outputs)
    assert outs[1].outputs[0].token_ids == plain


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, "2"]}, "allowed_token_ids"),
        ({"allowed_token_ids": 5}, "allowed_token_ids"),
        ({"bad_words": "word"}, "bad_words"),
        ({"bad_words": ["ok", ""]}, "bad_words"),
        ({"bad_words": ["  "]}, "bad_words"),
        ({"bad_words": [1]}, "bad_words"),
        ({"bad_words": ["\ud800"]}, "bad_words"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    refused(field, SamplingParams, **kwargs)


def test_what_needs_the_model_is_checked_when_the_request_comes(tiny_model):
    """Guards against an allowed id past the vocabulary (an index error on the device) and bad words on a model without
    a tokenizer being taken: each is refused by name, and the engine serves on."""
    path, hf = tiny_model("llama")
    llm = LLM(path, **ENGINE)
    prompt = random_prompts([5])[0]
    refused("allowed_token_ids", llm.generate, prompt, greedy(allowed_token_ids=[3, VOCAB]))
    refused("bad_words", llm.generate, prompt, greedy(bad_words=["word"]))
    out = llm.generate(prompt, greedy(), use_tqdm=False)[0]
    assert (
        out.outputs[0].token_ids
        == hf_generate(hf, prompt, max_new_tokens=NUM_TOKENS, eos_token_id=None)[0, len(prompt) :].tolist()
    )
    assert not llm.has_unfinished_requests() and llm.stats()["kv_blocks_used"] == 0


def test_bans_that_leave_no_token_are_refused_or_end_the_request(default_llm):
    """Guards against a request whose bans leave no token to sample drawing a banned one anyway (the sampler's argmax
    over a row of -inf is token 0): allowed ids that one-token bad words, or min_tokens (the stop ids), ban every one
    of are refused by name when the request comes; allowed ids that longer words ban at some step end the request
    there (finish reason "error", the error naming allowed_token_ids), with only allowed tokens before; the engine
    serves on."""
    llm, _ = default_llm
    tokenizer = llm.get_tokenizer()
    one, two = tokenizer.convert_tokens_to_ids(["1", "2"])  # digits are single tokens: "12" is [1, 2]
    prompt = tokenizer.encode("Count: 1 2 1 2")
    refused("allowed_token_ids", llm.generate, prompt, greedy(allowed_token_ids=[one], bad_words=["1"]), use_tqdm=False)
    eos_only = SamplingParams(temperature=0, allowed_token_ids=[tokenizer.eos_token_id], min_tokens=1)  # EOS stops
    refused("allowed_token_ids", llm.generate, prompt, eos_only, use_tqdm=False)
    every_pair = greedy(allowed_token_ids=[one, two], bad_words=["11", "12", "21", "22"])
    out = llm.generate(prompt, every_pair, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "error" and out.error.startswith("allowed_token_ids: "), out
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].token_ids[0] in (one, two)
    assert llm.stats()["kv_blocks_used"] == 0 and not llm.requests
    assert llm.generate(prompt, greedy(allowed_token_ids=[one, two]), use_tqdm=False)[0].outputs[0].finish_reason
