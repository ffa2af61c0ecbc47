"""Per-request sampling settings, checked when they are made: a bad type or value raises an InvalidField (a
ValueError naming the field) before any work starts. The server's 400 errors come from these same checks.

Every number has a finite, stated range, and the checks cannot fail themselves: any numbers.Real is taken (numpy's
scalars, Fraction; a Decimal is refused), compared exactly (an integer as an integer: 10**400 is out of range, never an
OverflowError), and stored as a plain Python int or float, so nothing downstream sees a numpy type."""

import math
import numbers
import reprlib
from dataclasses import dataclass, fields

MAX_INT = 2**63 - 1  # the largest count (or config size) accepted anywhere: it fits a torch.int64
SEED_RANGE = 2**63  # a seed is used mod this: torch's generators take 64-bit seeds
MAX_TEMPERATURE = 1e30  # far past where sampling is uniform to float32's precision; logits / T stays finite
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], OpenAI's range
MAX_LOGIT_BIAS = 100.0  # a logit_bias lies in [-100, 100], OpenAI's range: -100 bans a token in practice
LISTS = (list, tuple)  # where a list is asked for (prompts, token ids, stop strings, messages), a tuple does too
# check_numbers' limits for SamplingParams' number fields, integers where the field is an int (an integer's high is
# MAX_INT unless stated); min_tokens', whose high is max_tokens, are added in __post_init__
NUMBER_LIMITS = {
    "n": {"low": 1},
    "temperature": {"low": 0, "high": MAX_TEMPERATURE},
    "top_p": {"low": 0, "high": 1, "above_low": True},
    "top_k": {"low": -1},
    "min_p": {"low": 0, "high": 1},
    "max_tokens": {"low": 1},
    "seed": {"low": -math.inf, "high": math.inf},  # any integer: it is kept mod SEED_RANGE
    "logprobs": {"low": 0},
    "repetition_penalty": {"low": 0, "above_low": True},
    "presence_penalty": {"low": -MAX_PENALTY, "high": MAX_PENALTY},
    "frequency_penalty": {"low": -MAX_PENALTY, "high": MAX_PENALTY},
    "prompt_logprobs": {"low": 0},
}


class InvalidField(ValueError):
    """Bad input, with the name of the field at fault (the server reports it as OpenAI's `param`)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


def shown(value: object) -> str:
    """repr(value) for an error message, shortened by reprlib (a 401-digit integer is not worth repeating); one past
    4,300 digits Python refuses to print at all."""
    try:
        return reprlib.repr(value)
    except ValueError:
        return "a number too long to print"


def check_number(
    field: str,
    value: object,
    low: float,
    high: float = MAX_INT,
    integer: bool = False,
    above_low: bool = False,
) -> int | float:
    """value as a plain int (if integer) or float, when it is a finite real (an integer if asked; bool is neither) in
    [low, high], or (low, high] with above_low. An int or a Fraction is finite and compared exactly, never converted
    to a float before it is known to be in range."""
    kind = numbers.Integral if integer else numbers.Real
    is_kind = isinstance(value, kind) and not isinstance(value, bool)
    if not is_kind or not (isinstance(value, numbers.Rational) or math.isfinite(value)):
        wanted = "an integer" if integer else "a finite int or float"
        raise InvalidField(field, f"{shown(value)} is not {wanted}")
    if integer:
        value = int(value)  # numpy's too: compared as a Python int, exactly
    if value < low or (above_low and value == low) or value > high:
        opening = "(" if above_low else "["
        raise InvalidField(field, f"{shown(value)} is out of range {opening}{low}, {high}]")
    return value if integer else float(value)  # an integer is a Python int already


def check_numbers(settings: object, limits: dict[str, dict]) -> None:
    """The numbers and flags of the dataclass `settings`, as its field types say: each field that limits names goes
    through check_number with its limits, as an integer if the field is an int, and is stored back as a plain int or
    float; each bool field must be a bool (check_flag). A field whose default is None may be None: it is unset."""
    for field in fields(settings):
        value = getattr(settings, field.name)
        if value is None and field.default is None:
            continue
        if field.type in (bool, bool | None):
            check_flag(field.name, value)
        if field.name in limits:
            integer = field.type in (int, int | None)
            setattr(settings, field.name, check_number(field.name, value, integer=integer, **limits[field.name]))


def check_flag(field: str, value: object) -> None:
    """An on/off field must be a bool: a string "no" would be truthy."""
    if not isinstance(value, bool):
        raise InvalidField(field, f"{shown(value)} is not a bool")


def check_text(field: str, text: str) -> None:
    """Text must be valid Unicode: a lone surrogate ("\\ud800", from broken UTF-16) has no UTF-8 form, and the
    tokenizer would fail on it with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidField(field, f"has a lone surrogate at index {error.start}; text must be valid Unicode") from None


def is_integer(value: object) -> bool:
    """An integer of any integer type (numpy's, a tensor element's), but not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_token_ids(field: str, ids: object, vocab_size: int | None = None) -> list[int]:
    """A list of integer token ids (a numpy array or tensor of them is fine), each in [0, vocab_size) where the
    vocabulary is known: returned as plain ints. SamplingParams, made before there is a model, checks only the types;
    the engine checks the range when the request comes (LLM._make_request)."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()  # a numpy array or a tensor
    if not isinstance(ids, LISTS) or not all(map(is_integer, ids)):
        raise InvalidField(field, "expected a list of integer token ids")
    if vocab_size is not None and not all(0 <= t < vocab_size for t in ids):
        raise InvalidField(field, f"token ids must lie in [0, {vocab_size})")
    return [int(t) for t in ids]


@dataclass
class SamplingParams:
    """The ranges, beyond the comments below: counts (n, top_k, max_tokens, logprobs, prompt_logprobs) are at most
    MAX_INT; any integer seed is taken and kept mod SEED_RANGE, in [0, 2**63), as the sampler uses it anyway."""

    n: int = 1  # completions of the prompt; they share its KV through the prefix cache
    temperature: float = 1.0  # in [0, MAX_TEMPERATURE = 1e30]; 0 means greedy: exact argmax
    top_p: float = 1.0  # in (0, 1]: keep the smallest set of tokens whose probability reaches top_p
    top_k: int = -1  # keep the k most likely tokens; -1 keeps all (vLLM's convention)
    min_p: float = 0.0  # in [0, 1]: drop tokens less likely than min_p x the top token's probability
    max_tokens: int = 64
    min_tokens: int = 0  # EOS and stop ids cannot be sampled, and stop strings do not count, before this
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None  # reproducible samples, whatever else is batched; any int, kept mod 2**63: [0, 2**63)
    # the chosen token's logprob and the top-N logprobs, of the model's own distribution (as vLLM returns them):
    # before the bias, penalties, filters and temperature
    logprobs: int | None = None
    # logit_bias and penalties (penalties.py), before temperature and the filters, in vLLM's order
    logit_bias: dict[int, float] | None = None  # {token id: bias in [-100, 100]} added to the logits
    repetition_penalty: float = 1.0  # > 0, 1 is off: ids in the prompt or output so far, logit > 0 / it, < 0 x it
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted from the logit of every id in the output so far
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted once per occurrence of the id in the output so far
    include_stop_str_in_output: bool = False  # keep the stop string (or the stop id's text) in the text
    skip_special_tokens: bool = True  # special tokens' text (<|im_end|>, ...) left out of the text
    prompt_logprobs: int | None = None  # per prompt token: its logprob and the top-N at its position (the first: None)
    # the output must match a JSON schema, a regex, a choice or a grammar: structured.py's StructuredOutputsParams or
    # a dict of its fields (vLLM's names), checked there (with xgrammar, an optional dependency)
    structured_outputs: object = None

    def __post_init__(self) -> None:
        # min_tokens' high is max_tokens, a valid count by then: it comes first among the fields
        check_numbers(self, NUMBER_LIMITS | {"min_tokens": {"low": 0, "high": self.max_tokens}})
        if self.top_k == 0:
            raise InvalidField("top_k", "0 is out of range: -1 keeps all tokens, k >= 1 keeps k")
        if self.seed is not None:
            self.seed %= SEED_RANGE
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []  # one stop string, a list, or None
        if not isinstance(stop, LISTS) or not all(isinstance(s, str) and s for s in stop):
            raise InvalidField("stop", f"{shown(self.stop)} is not a non-empty string or a list of them")
        self.stop = list(stop)
        self.stop_token_ids = check_token_ids("stop_token_ids", self.stop_token_ids or [])
        bias = {} if self.logit_bias is None else self.logit_bias
        if not isinstance(bias, dict) or not all(map(is_integer, bias)):
            raise InvalidField("logit_bias", f"{shown(bias)} is not a dict of {{integer token id: bias}}")
        # as plain ints and floats; the ids are checked against the vocabulary where it is known (LLM._make_request)
        self.logit_bias = {
            int(t): check_number("logit_bias", b, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS) for t, b in bias.items()
        }
        if self.structured_outputs is not None:
            from nanoserve.structured import structured_outputs_params

            self.structured_outputs = structured_outputs_params(self.structured_outputs)
        # derived, read for every row of every step (attributes: a property cost 40 us a step at 256 rows): the three
        # penalties in the order penalties.py reads them, and whether a bias or a penalty applies, so that the sampler
        # needs this request's row of counts (penalties.py)
        self.penalties = (self.repetition_penalty, self.presence_penalty, self.frequency_penalty)
        self.penalized = bool(self.logit_bias) or self.penalties != (1, 0, 0)
        # derived too: whether top-k, top-p or min-p trims the distribution before the draw (sampler.drop_filtered)
        self.filtered = self.top_k > 0 or self.top_p < 1 or self.min_p > 0
