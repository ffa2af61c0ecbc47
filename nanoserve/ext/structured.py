"""An extension, structured outputs: a completion constrained to a JSON schema, any JSON object, a regex, one of a list
of choices, or an EBNF grammar (vLLM's StructuredOutputsParams), with xgrammar, the grammar engine vLLM and SGLang use.
This is the only file that imports xgrammar (an optional dependency, in the `[serve]` extra), and only when a
constrained request comes: the engine runs without it.

The idea: a grammar is compiled once against the tokenizer's vocabulary; each sequence then walks it with its own
GrammarMatcher. Before each of its tokens is sampled, the matcher writes the set of tokens that keep the output valid
as a bitmask (one bit per vocabulary entry, on the host), and every other token's logit becomes -inf on the device: a
logits processor (sampler.py's LogitsProcessor). The tokens sampled since are accepted first, which moves the matcher
on. So the matcher must have seen a sequence's newest token before its next mask is made: while a constrained sequence
runs, this processor needs the tokens on the host, and the engine does not overlap steps (llm.py)."""

import json
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanoserve.checks import InvalidField, shown
from nanoserve.sampling_params import SamplingParams
from nanoserve.sequence import Sequence

if TYPE_CHECKING:  # for annotations only
    import xgrammar
    from torch import Tensor
    from transformers import PreTrainedTokenizerBase

    from nanoserve.llm import LLM

NAME = "structured"  # this extension's name in the registry (ext/__init__.py)
FIELD = "structured_outputs"  # the field of SamplingParams it owns
INSTALL_HINT = (
    'structured outputs need xgrammar: pip install xgrammar (or nanoserve\'s extra: pip install -e ".[serve]")'
)
# one grammar compiler per tokenizer: it holds the vocabulary's token table, which takes a while to build, and caches
# the grammars it compiled. Keyed weakly: a tokenizer's compiler goes with it
_compilers: "weakref.WeakKeyDictionary[PreTrainedTokenizerBase, xgrammar.GrammarCompiler]" = weakref.WeakKeyDictionary()


@dataclass
class StructuredOutputsParams:
    """What the output must match, as vLLM names it: exactly one of the fields is set. Checked when made (an invalid
    schema, regex or grammar is an InvalidField naming structured_outputs); `rules` is the parsed grammar."""

    json: dict | str | None = None  # a JSON schema, as a dict or a JSON string
    regex: str | None = None
    choice: list[str] | None = None  # the output is one of these strings
    grammar: str | None = None  # EBNF (xgrammar's dialect of GBNF: root ::= ...)
    json_object: bool | None = None  # True: any JSON object

    def __post_init__(self) -> None:
        given = [name for name, value in vars(self).items() if value not in (None, False)]  # the fields, so far
        if len(given) != 1:
            raise InvalidField(FIELD, f"set exactly one of json, regex, choice, grammar, json_object; got {given}")
        try:
            import xgrammar  # here first: later steps (attach) find it imported

            self.rules = self._parse(xgrammar.Grammar)
        except ImportError:
            raise InvalidField(FIELD, INSTALL_HINT) from None
        except (RuntimeError, TypeError, ValueError) as error:  # xgrammar's parse errors (json=5: a ValueError)
            problem = str(error).split(": ", 1)[-1].strip()  # without xgrammar's "[time] file.cc:line: " in front
            raise InvalidField(FIELD, f"{given[0]}: {problem}") from None

    def _parse(self, grammar: "type[xgrammar.Grammar]") -> "xgrammar.Grammar":
        if self.choice is not None:
            if not isinstance(self.choice, list) or not all(isinstance(c, str) for c in self.choice):
                raise TypeError(f"{shown(self.choice)} is not a list of strings")
            # each choice as a string literal (EBNF's escapes are JSON's); no choices: an empty rule, refused
            return grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice))
        if self.regex is not None:
            return grammar.from_regex(self.regex)
        if self.grammar is not None:
            return grammar.from_ebnf(self.grammar)
        if self.json is None and self.json_object is not True:  # json_object alone, but not True (1, "yes")
            raise TypeError(f"{shown(self.json_object)} is not a bool")
        # json, or json_object: any object. Compact JSON (no whitespace between tokens): a small model given any
        # whitespace may emit it forever
        schema = {"type": "object"} if self.json is None else self.json
        return grammar.from_json_schema(schema, any_whitespace=False)


def check_params(params: SamplingParams) -> None:
    """SamplingParams' structured_outputs as StructuredOutputsParams: one already, or a dict of its fields."""
    value = params.structured_outputs
    try:
        if not isinstance(value, StructuredOutputsParams):
            params.structured_outputs = StructuredOutputsParams(**value)
    except TypeError:  # not a dict, or a key that is no field
        raise InvalidField(FIELD, f"{shown(value)} is not StructuredOutputsParams or a dict of its fields") from None


class StructuredMatcher:
    """One sequence's place in its grammar: masks its row of logits, and accepts the tokens it samples."""

    def __init__(self, compiled: "xgrammar.CompiledGrammar", vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        import xgrammar  # imported already: the request's params were made with it

        self.xgr = xgrammar
        # the grammar may end only on a token the engine stops on (None: the tokenizer's EOS, with ignore_eos)
        self.matcher = xgrammar.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_token_ids) or None)
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)  # [1, vocab / 32] int32, on the host
        self.num_accepted = 0  # completion tokens the matcher has moved past

    def catch_up(self, seq: Sequence) -> None:
        """Accept seq's completion tokens read back since the last call (the mask allowed each)."""
        for token_id in seq.completion_token_ids[self.num_accepted :]:
            self.matcher.accept_token(token_id)
        self.num_accepted = len(seq.completion_token_ids)

    def mask(self, logits: "Tensor") -> None:
        """logits: [vocab], one row on the device: every token the grammar does not allow next becomes -inf. A
        finished grammar (its stop token sampled but ignored) constrains nothing further."""
        if not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(self.bitmask)
            self.xgr.apply_token_bitmask_inplace(logits[None], self.bitmask.to(logits.device, non_blocking=True))


@dataclass
class StepMasks:
    """One step's constrained rows: (row of the logits, its sequence's matcher), caught up with its tokens."""

    rows: list[tuple[int, StructuredMatcher]]

    def apply(self, logits: "Tensor") -> None:
        for row, matcher in self.rows:
            matcher.mask(logits[row])  # the tokens its grammar does not allow next: -inf

    def sampled(self, tokens: "Tensor") -> None:
        """Nothing here: the next step's prepare accepts the tokens, once they are read back."""


class StructuredOutputs:
    """The logits processor: a matcher per constrained sequence, forgotten once the sequence has finished (or, weakly
    keyed, once nothing holds it: a request refused before it was queued)."""

    def __init__(self) -> None:
        self.matchers: weakref.WeakKeyDictionary[Sequence, StructuredMatcher] = weakref.WeakKeyDictionary()

    def needs_tokens_on_host(self) -> bool:
        return any(not seq.is_finished for seq in self.matchers)

    def prepare(self, seqs: list[Sequence]) -> StepMasks | None:
        for seq in [s for s in self.matchers if s.is_finished]:
            del self.matchers[seq]
        rows = []
        for row, seq in enumerate(seqs):
            matcher = self.matchers.get(seq)
            if matcher is not None:
                matcher.catch_up(seq)  # the tokens read back since its last mask
                rows.append((row, matcher))
        return StepMasks(rows) if rows else None


def attach(llm: "LLM", seqs: list[Sequence]) -> None:
    """Each sequence of a constrained request (its n samples) gets its own matcher of the request's grammar,
    compiled for the model's vocabulary (which may be larger than the tokenizer's: the extra ids are never allowed)."""
    tokenizer = llm.tokenizer
    if tokenizer is None:
        raise InvalidField(FIELD, "needs a tokenizer; this model has none")
    import xgrammar  # imported already: the request's params were made with it

    if tokenizer not in _compilers:
        _compilers[tokenizer] = xgrammar.GrammarCompiler(
            xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=llm.vocab_size)
        )
    compiled = _compilers[tokenizer].compile_grammar(seqs[0].params.structured_outputs.rules)
    processor = llm.logits_processors.setdefault(NAME, StructuredOutputs())
    for seq in seqs:
        processor.matchers[seq] = StructuredMatcher(compiled, llm.vocab_size, seq.stop_token_ids)
