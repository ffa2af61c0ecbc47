"""The stop rules and incremental text (nanoserve/stopping.py) with the default model's real byte-level tokenizer,
where a CJK character or an emoji takes several tokens: tokens are fed one at a time, as the engine reads them
back, and the streamed deltas, the final text and where it stops are checked against plain string operations on
the whole decoded text. One end-to-end test runs the model itself."""

import pytest

pytest.importorskip("gguf")
from nanoserve import SamplingParams  # noqa: E402
from nanoserve.sequence import Sequence, SequenceStatus  # noqa: E402
from nanoserve.stopping import StopChecker, take_stream_delta  # noqa: E402

PROMPT = [1]  # any prompt: only completion tokens are decoded
IM_END = 2  # SmolLM2's end-of-turn token


@pytest.fixture(scope="module")
def tokenizer():
    from conftest import default_model_or_skip
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_or_skip())


def feed(tokenizer, token_ids, stream=True, **params):
    """Read token_ids back one by one through the StopChecker; returns (reason, deltas, tokens consumed, seq)."""
    params.setdefault("max_tokens", len(token_ids))
    seq = Sequence(PROMPT, SamplingParams(**params), 16, stop_token_ids=frozenset({IM_END}))
    checker, deltas = StopChecker(tokenizer, max_model_len=4096), []
    for n, token in enumerate(token_ids, 1):
        seq.append_pending()
        seq.resolve_pending(token)
        reason = checker.check(seq, incremental=stream)
        if reason:
            seq.status = SequenceStatus.FINISHED
        deltas.append(take_stream_delta(seq) if stream else "")
        if reason:
            return reason, deltas, n, seq
    return None, deltas, len(token_ids), seq


MIXED = "Héllo 世界! 🙂🚀 naïve café — 日本語のテキストと中文的句子。Ünïcödé ✓"


def test_streamed_text_is_whole_characters_and_adds_up(tokenizer):
    """Guards against broken UTF-8 at token boundaries (a character or emoji split across tokens streamed as
    U+FFFD, or twice) and against deltas that do not add up to the final text."""
    ids = tokenizer.encode(MIXED)
    assert len(ids) > len(MIXED) // 2 + 8, "the text should have many multi-token characters"
    reason, deltas, _, seq = feed(tokenizer, ids)
    assert reason == "length" and "".join(deltas) == seq.text.final == tokenizer.decode(ids) == MIXED
    assert all("\ufffd" not in d for d in deltas) and sum(bool(d) for d in deltas) > 10


def test_long_stop_string_in_multi_token_characters(tokenizer):
    """Guards against a stop string being missed when its characters take several tokens each (a window counted
    in tokens, one token per character assumed): a 12-character CJK stop string of ~30 tokens must stop the
    sequence on the token that completes it, and is never streamed, even in part."""
    text = "今天天气很好，我们一起去公园散步吧，然后去吃饭。明天见！"
    stop = text[6:18]  # "我们一起去公园散步吧，然"
    ids = tokenizer.encode(text)
    reason, deltas, consumed, seq = feed(tokenizer, ids, stop=[stop])
    assert len(tokenizer.encode(stop)) > 2 * len(stop) - 4
    assert reason == "stop" and seq.text.final == text[:6] == "".join(deltas)
    assert stop in tokenizer.decode(ids[:consumed]) and stop not in tokenizer.decode(ids[: consumed - 1])


def test_stop_string_before_min_tokens_does_not_cut_later(tokenizer):
    """Guards against cutting the text at an occurrence of the stop string that came before min_tokens (and so
    did not count) when a later occurrence ends the request: the text must run to the later one."""
    text = "The answer is here. We looked for the answer everywhere, and the answer was simple."
    ids = tokenizer.encode(text)
    first_end = next(n for n in range(len(ids)) if "answer" in tokenizer.decode(ids[:n]))
    reason, deltas, _, seq = feed(tokenizer, ids, stop=["answer"], min_tokens=first_end + 1)
    assert reason == "stop" and seq.text.final == "The answer is here. We looked for the " == "".join(deltas)


def test_partial_stop_string_is_held_back_then_released(tokenizer):
    """Guards against streaming the start of what could still become a stop string (here 'END' whose 'E' starts
    'Every'), and against holding text back for ever once it cannot."""
    text = "Every end is near. THE END is here."
    ids = tokenizer.encode(text)
    reason, deltas, _, seq = feed(tokenizer, ids, stop=["END!"])
    assert reason == "length" and "".join(deltas) == text
    streamed = ""
    for d in deltas:
        streamed += d
        assert not any(streamed.endswith("END!"[:k]) for k in (1, 2, 3)) or streamed == text


def test_stop_id_text_is_not_shown_and_min_tokens_defers_it(tokenizer):
    """Guards against showing the text of the token that stopped the sequence, and against stopping on a stop
    id before min_tokens tokens exist."""
    ids = tokenizer.encode("Hello there, friend")
    reason, deltas, consumed, seq = feed(tokenizer, ids + [IM_END] + ids)
    assert reason == "stop" and consumed == len(ids) + 1 and seq.text.final == "Hello there, friend"
    reason, _, consumed, seq = feed(tokenizer, ids + [IM_END] + ids, stream=False, min_tokens=len(ids) + 3)
    assert reason == "length" and seq.text.final == tokenizer.decode(ids + [IM_END] + ids, skip_special_tokens=True)


def test_engine_stops_on_a_long_cjk_stop_string():
    """End to end with the default model: greedy Japanese text; a 12-character stop string of about 24 tokens
    (two per character, more than a window of one token per character plus slack covers) must end the request
    where it starts, instead of running to max_tokens."""
    from conftest import default_model_or_skip

    from nanoserve import LLM

    llm = LLM(default_model_or_skip(), max_model_len=256, device="cpu")
    prompt = "日本の首都は東京です。東京は"
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    stop = free.text[1:13]
    assert len(llm.tokenizer.encode(stop)) >= len(stop) + 9, f"unexpected free text {free.text!r}"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, stop=[stop]), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text == free.text[: free.text.find(stop)]
    assert len(out.outputs[0].token_ids) < len(free.token_ids)


def test_include_stop_str_in_output_keeps_the_stop_string_and_the_stop_ids_text(tokenizer):
    """Guards against include_stop_str_in_output ignored (vLLM's meaning: the matched stop string, or the stop id's
    own text, stays in the text, and streamed deltas still add up to it) or cutting the text elsewhere."""
    text = "The answer is here. And more after it."
    ids = tokenizer.encode(text)
    reason, deltas, _, seq = feed(tokenizer, ids, stop=["is here"], include_stop_str_in_output=True)
    assert reason == "stop" and seq.text.final == "The answer is here" == "".join(deltas)
    start = tokenizer.encode("<|im_start|>")  # a special token that is not a stop id
    both = {"include_stop_str_in_output": True, "skip_special_tokens": False}
    reason, deltas, _, seq = feed(tokenizer, ids[:3] + start + [IM_END] + ids, **both)
    assert reason == "stop" and seq.text.final == tokenizer.decode(ids[:3]) + "<|im_start|><|im_end|>"
    assert "".join(deltas) == seq.text.final


def test_skip_special_tokens_false_shows_special_tokens_but_not_the_stop_id(tokenizer):
    """Guards against skip_special_tokens ignored: with False a special token's text is shown (<|im_start|> here),
    while the stop id that ends the text is still left out (include_stop_str_in_output is off); with True (the
    default) neither is."""
    ids = tokenizer.encode("Hi") + tokenizer.encode("<|im_start|>") + tokenizer.encode("there") + [IM_END]
    for skip, shown in ((False, "Hi<|im_start|>there"), (True, "Hithere")):
        reason, deltas, _, seq = feed(tokenizer, ids, skip_special_tokens=skip)
        assert reason == "stop" and seq.text.final == shown == "".join(deltas)


def test_a_streamed_sequence_ends_without_decoding_again(tokenizer, monkeypatch):
    """Guards against work done twice at the end of a streamed sequence: once every token has been decoded
    incrementally, the length limit (or a stop id whose text is not shown) must not decode the same ids again. Plain
    ASCII words, so no token waits for the rest of a character: two decodes per token, none more."""
    ids = tokenizer.encode(" the cat sat on the mat and looked at the dog")
    calls = []
    decode = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda *a, **k: calls.append(1) or decode(*a, **k))
    reason, deltas, _, seq = feed(tokenizer, ids)
    assert reason == "length" and "".join(deltas) == seq.text.final == decode(ids)
    assert len(calls) == 2 * len(ids)
    calls.clear()
    reason, _, n, seq = feed(tokenizer, ids[:3] + [IM_END], max_tokens=10)
    assert reason == "stop" and n == 4 and seq.text.final == decode(ids[:3]) and len(calls) == 2 * 3
