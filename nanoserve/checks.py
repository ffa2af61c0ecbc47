"""Checks of user input, shared by every part that takes some: a bad type or value raises an InvalidField (a ValueError
naming the field) before any work starts. The server's 400 errors come from these same checks.

Every number has a finite, stated range, and the checks cannot fail themselves: any numbers.Real is taken (numpy's
scalars, Fraction; a Decimal is refused), compared exactly (an integer as an integer: 10**400 is out of range, never an
OverflowError), and stored as a plain Python int or float, so nothing downstream sees a numpy type."""

import math
import numbers
import reprlib
from dataclasses import fields

MAX_INT = 2**63 - 1  # the largest count (or config size) accepted anywhere: it fits a torch.int64
LISTS = (list, tuple)  # where a list is asked for (prompts, token ids, stop strings, messages), a tuple does too


class InvalidField(ValueError):
    """Bad input, with the name of the field at fault (the server reports it as OpenAI's `param`)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class Settings:
    """The base of the settings dataclasses (EngineConfig, SamplingParams, BeamSearchParams): a keyword that is no
    field is an InvalidField naming it, not the dataclass's bare TypeError: a misspelling, or one of vLLM's options
    that nanoserve does not implement (LLM(...) hands those to vLLM's names first: EngineConfig.from_kwargs).
    copy.deepcopy, pickle and dataclasses.replace come here too, with no keyword or only known ones."""

    def __new__(cls, *args: object, **kwargs: object) -> "Settings":
        if unknown := kwargs.keys() - {field.name for field in fields(cls)}:
            raise InvalidField(min(unknown), f"unknown keyword: {cls.__name__} has no such field (misspelt, or vLLM's)")
        return object.__new__(cls)


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
    if integer:
        if not is_integer(value):
            raise InvalidField(field, f"{shown(value)} is not an integer")
        value = int(value)  # numpy's too: compared as a Python int, exactly
    elif not is_finite_real(value):
        raise InvalidField(field, f"{shown(value)} is not a finite int or float")
    if value < low or (above_low and value == low) or value > high:
        opening = "["
        if above_low:
            opening = "("
        raise InvalidField(field, f"{shown(value)} is out of range {opening}{low}, {high}]")
    if integer:
        return value  # a Python int already
    return float(value)


def check_numbers(settings: object, limits: dict[str, dict]) -> None:
    """The numbers and flags of the dataclass `settings`, as its field types say: each field that limits names goes
    through check_number with its limits, as an integer if the field is an int, and is stored back as a plain int or
    float; each bool field must be a bool (check_flag). A field whose default is None may be None: it is unset."""
    for field in fields(settings):
        name = field.name
        value = getattr(settings, name)
        if value is None and field.default is None:
            continue
        if field.type in (bool, bool | None):
            check_flag(name, value)
        if name in limits:
            integer = field.type in (int, int | None)
            setattr(settings, name, check_number(name, value, integer=integer, **limits[name]))


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


def is_finite_real(value: object) -> bool:
    """A real number of any type (numpy's, a Fraction; not a bool, nor a Decimal) that is finite: an int or a Fraction
    is, and is never converted to a float to find out (10**400 would overflow)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    return isinstance(value, numbers.Rational) or math.isfinite(value)


def check_token_ids(
    field: str,
    ids: object,
    vocab_size: int | None = None,
) -> list[int]:
    """A list of integer token ids (a numpy array or a dense tensor of them is fine; a sparse or meta tensor is
    refused by name; None is no ids), each in [0, vocab_size) where the vocabulary is known: returned as plain ints.
    SamplingParams, made before there is a model, checks only the types; the engine checks the range when the request
    comes (LLM._make_request)."""
    try:
        if hasattr(ids, "tolist"):  # a numpy array or a tensor
            ids = ids.tolist()
        elif not ids:  # None: no ids
            ids = []
    except Exception:  # a tensor whose values cannot be read (sparse, on the meta device): refused below, by name
        ids = None
    if not isinstance(ids, LISTS) or not all(map(is_integer, ids)):
        raise InvalidField(field, "expected a list of integer token ids")
    if vocab_size is not None and not all(0 <= t < vocab_size for t in ids):
        raise InvalidField(field, f"token ids must lie in [0, {vocab_size})")
    return list(map(int, ids))
