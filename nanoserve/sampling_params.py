"""Per-request sampling settings, checked when they are made: a bad type or value raises an InvalidField (a
ValueError naming the field) before any work starts. The server's 400 errors come from these same checks."""

import math
import numbers
from dataclasses import dataclass


class InvalidField(ValueError):
    """Bad input, with the name of the field at fault (the server reports it as OpenAI's `param`)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


def describe_range(low: float | None, high: float | None, above_low: bool) -> str:
    """'[low, high]', or '(low, high]' when low itself is out; a missing bound shows as -inf or inf."""
    opening = "(" if above_low else "["
    lower = "-inf" if low is None else low
    upper = "inf" if high is None else high
    return f"{opening}{lower}, {upper}]"


def check_number(
    field: str,
    value: object,
    low: float | None = None,
    high: float | None = None,
    integer: bool = False,
    above_low: bool = False,
) -> None:
    """value must be a finite real (an integer if asked; bool is neither) in [low, high], or (low, high]."""
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value):
        wanted = "an integer" if integer else "a finite number"
        raise InvalidField(field, f"{value!r} is not {wanted}")
    too_low = low is not None and (value < low or (above_low and value == low))
    too_high = high is not None and value > high
    if too_low or too_high:
        raise InvalidField(field, f"{value!r} is out of range {describe_range(low, high, above_low)}")


def is_token_id(value: object) -> bool:
    """An integer of any integer type (numpy's, a tensor element's), but not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_token_ids(field: str, ids: object) -> list[int]:
    """A list of integer token ids (a numpy array or tensor of them is fine): returned as plain ints."""
    if hasattr(ids, "tolist") and not isinstance(ids, (list, tuple)):
        ids = ids.tolist()  # a numpy array or a tensor
    if not isinstance(ids, (list, tuple)) or not all(is_token_id(t) for t in ids):
        raise InvalidField(field, "expected a list of integer token ids")
    return [int(t) for t in ids]


@dataclass
class SamplingParams:
    n: int = 1  # completions of the prompt; they share its KV through the prefix cache
    temperature: float = 1.0  # 0 means greedy: exact argmax
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = -1  # keep the k most likely tokens; -1 keeps all (vLLM's convention)
    min_p: float = 0.0  # drop tokens less likely than min_p x the top token's probability
    max_tokens: int = 64
    min_tokens: int = 0  # EOS and stop ids cannot be sampled, and stop strings do not count, before this
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None  # makes this request's samples reproducible, whatever else is batched
    logprobs: int | None = None  # return the chosen token's logprob and the top-N logprobs

    def __post_init__(self) -> None:
        check_number("n", self.n, low=1, integer=True)
        check_number("temperature", self.temperature, low=0)
        check_number("top_p", self.top_p, low=0, high=1, above_low=True)
        check_number("top_k", self.top_k, low=-1, integer=True)
        if self.top_k == 0:
            raise InvalidField("top_k", "0 is out of range: -1 keeps all tokens, k >= 1 keeps k")
        check_number("min_p", self.min_p, low=0, high=1)
        check_number("max_tokens", self.max_tokens, low=1, integer=True)
        check_number("min_tokens", self.min_tokens, low=0, high=self.max_tokens, integer=True)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidField("ignore_eos", f"{self.ignore_eos!r} is not a bool")
        if self.seed is not None:
            check_number("seed", self.seed, integer=True)
        if self.logprobs is not None:
            check_number("logprobs", self.logprobs, low=0, integer=True)
        if isinstance(self.stop, str):
            stop = [self.stop]  # one stop string
        else:
            stop = self.stop or []
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise InvalidField("stop", f"{self.stop!r} is not a non-empty string or a list of them")
        self.stop = list(stop)
        self.stop_token_ids = check_token_ids("stop_token_ids", self.stop_token_ids or [])

    @property
    def filtered(self) -> bool:
        """Whether top-k, top-p or min-p trims the distribution before the draw."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0
