"""Per-request settings, checked when they are made: a bad type or value raises an InvalidField (a ValueError naming the
field, checks.py) before any work starts, and so does a keyword that is no field. SamplingParams holds vLLM's fields;
those that belong to an extension (n > 1: ext/parallel_sampling.py; logit_bias and the penalties: ext/penalties.py;
structured_outputs: ext/structured.py; allowed_token_ids and bad_words: ext/token_bans.py) are checked by it, and
refused by name where it is not installed, unless left at the value that asks for nothing (ext/__init__.py's tables).
BeamSearchParams, the settings of LLM.beam_search, is found here too, where vLLM keeps it: it is the beam-search
extension's (ext/beam_search.py)."""

import math
from dataclasses import dataclass

from nanoserve.checks import LISTS, InvalidField, Settings, check_numbers, check_token_ids, shown
from nanoserve.ext import REQUEST_FIELDS, extensions_asked, load

SEED_RANGE = 2**63  # a seed is used mod this: torch's generators take 64-bit seeds
MAX_TEMPERATURE = 1e30  # far past where sampling is uniform to float32's precision; logits / T stays finite
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
    "prompt_logprobs": {"low": 0},
    "truncate_prompt_tokens": {"low": 1},
}


@dataclass
class SamplingParams(Settings):
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
    # logit_bias and penalties (ext/penalties.py), before temperature and the filters, in vLLM's order
    logit_bias: dict[int, float] | None = None  # {token id: bias in [-100, 100]} added to the logits
    repetition_penalty: float = 1.0  # > 0, 1 is off: ids in the prompt or output so far, logit > 0 / it, < 0 x it
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted from the logit of every id in the output so far
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted once per occurrence of the id in the output so far
    include_stop_str_in_output: bool = False  # keep the stop string (or the stop id's text) in the text
    skip_special_tokens: bool = True  # special tokens' text (<|im_end|>, ...) left out of the text
    prompt_logprobs: int | None = None  # per prompt token: its logprob and the top-N at its position (the first: None)
    # the output must match a JSON schema, a regex, a choice or a grammar: ext/structured.py's StructuredOutputsParams
    # or a dict of its fields (vLLM's names), checked there (with xgrammar, an optional dependency)
    structured_outputs: object = None
    # only these ids may be sampled; these words (strings, as the tokenizer splits them) never are (ext/token_bans.py)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last N tokens (vLLM's truncation: from the left)
    detokenize: bool = True  # False: token ids only, no text (text "", no text deltas), so no stop strings either

    def __post_init__(self) -> None:
        # min_tokens' high is max_tokens, a valid count by then: it comes first among the fields
        check_numbers(self, NUMBER_LIMITS | {"min_tokens": {"low": 0, "high": self.max_tokens}})
        if self.top_k == 0:
            raise InvalidField("top_k", "0 is out of range: -1 keeps all tokens, k >= 1 keeps k")
        if self.seed is not None:
            self.seed %= SEED_RANGE
        stop = self.stop or []  # a list of stop strings, or None
        if isinstance(self.stop, str):  # one stop string
            stop = [self.stop]
        non_empty_strings = isinstance(stop, LISTS) and all(isinstance(s, str) and s for s in stop)
        if not non_empty_strings:
            raise InvalidField("stop", f"{shown(self.stop)} is not a non-empty string or a list of them")
        if stop and not self.detokenize:  # a stop string is found in the text, which detokenize=False never makes
            raise InvalidField("stop", "stop strings need detokenize=True: they are matched in the text")
        self.stop = list(stop)
        self.stop_token_ids = check_token_ids("stop_token_ids", self.stop_token_ids)
        # the fields that belong to an extension, each checked by it (and the extension refused by name if missing);
        # `extensions` names those this request uses, for LLM.add_request to attach it to each (ext/__init__.py)
        asked = extensions_asked(self, REQUEST_FIELDS)
        for name, field in asked.items():
            load(name, field).check_params(self)
        self.extensions = tuple(asked)
        # derived, read for every row of every step: whether top-k, top-p or min-p trims the distribution before the
        # draw (sampler.drop_filtered)
        self.filtered = self.top_k > 0 or self.top_p < 1 or self.min_p > 0


def __getattr__(name: str) -> object:
    """BeamSearchParams, where vLLM keeps it: the beam-search extension's (ext/beam_search.py), found by name."""
    if name == "BeamSearchParams":
        return load("beam_search", name).BeamSearchParams
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
