"""An extension, structured outputs: a completion constrained to a JSON schema, any JSON object, a regex, one of a list
of choices, or an EBNF grammar (vLLM's StructuredOutputsParams), with xgrammar, the grammar engine vLLM and SGLang use.
This is the only file that imports xgrammar (an optional dependency, in the `[serve]` extra), and only when a
constrained request comes: the engine runs without it.

The idea: a grammar is compiled once against the tokenizer's vocabulary; each sequence then walks it with its own
GrammarMatcher. Before each of its tokens is sampled, the matcher writes the set of tokens that keep the output valid
as a bitmask (one bit per vocabulary entry, on the host), and every other token's logit becomes -inf on the device: a
logits processor (sampler.py's LogitsProcessor). The tokens sampled since are accepted first, which moves the matcher
on. So the matcher must have seen a sequence's newest token before its next mask is made: while a constrained sequence
runs, this processor needs the tokens on the host, and the engine does not overlap steps (llm.py).

Compiling is the heavy part (seconds for a large schema), so it runs beside the steps (ext/background.py): a
constrained request waits in the queue until its grammar is compiled (this extension's admission rule), while the
others run; the compiled grammars are kept by their text, so a request that brings the same one again finds it ready.
Its limits, each refused by name (structured_outputs): the grammar's text (a schema's JSON, a regex, an EBNF grammar, or
the choices) at most MAX_GRAMMAR_CHARS characters, checked before it is parsed; its compile at most COMPILE_LIMIT_S
seconds (past it, the request ends with an error; the thread finishes the compile). A request whose constraints leave
no token to sample ends, with an error that says so, before the token would be drawn: when its sequence is admitted
(allowed_token_ids that the grammar's start allows none of: before any work) or at any later step (the grammar's next
tokens all outside allowed_token_ids, or all stop ids that min_tokens bans)."""

import json
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from nanoserve.checks import InvalidField, shown
from nanoserve.ext.background import Prepared
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
# The longest grammar text accepted. Compile time grows faster than the text (on this project's 2-core CPU VM, with
# SmolLM2's 49,152 tokens, 2026-12-06): at 32 KiB, 0.1 s for 900 required properties or 1,600 enum values, 2.4 s for
# 1,100 optional ones (xgrammar's worst shape found); at 64 KiB the optional ones take 35 s, at 128 KiB 296 s
MAX_GRAMMAR_CHARS = 32_768
# the longest a compile may run, in wall time: a safety net for a shape the size limit does not bound (or a stuck
# worker), far above what one within it takes: 2.4 s of CPU, but up to ~50 s at the worker's lower priority on this
# VM while other processes kept both cores busy (load average 7)
COMPILE_LIMIT_S = 120.0
KEEP_GRAMMARS = 64  # compiled grammars kept beyond those in use, for requests that bring them again
# one grammar compiler per tokenizer: it holds the vocabulary's token table, which takes a while to build. Keyed
# weakly: a tokenizer's compiler goes with it. Made and used on the background thread only
_compilers: "weakref.WeakKeyDictionary[PreTrainedTokenizerBase, xgrammar.GrammarCompiler]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class GrammarKey:
    """A grammar's name: its kind and text (equal texts share one compile: Prepared's key), with the grammar as parsed
    when its request's params were made, which the compile takes rather than parse the text again (work done once;
    a parse is small beside a compile: ~5 ms for the largest schema MAX_GRAMMAR_CHARS admits, on this project's 2-core
    CPU VM); not part of the name."""

    kind: str  # "json", "regex" or "grammar"
    text: str
    rules: "xgrammar.Grammar" = field(compare=False, repr=False)


@dataclass
class StructuredOutputsParams:
    """What the output must match, as vLLM names it: exactly one of the fields is set. Checked when made (an invalid
    schema, regex or grammar, or one longer than MAX_GRAMMAR_CHARS, is an InvalidField naming structured_outputs);
    `key` names its grammar (GrammarKey), and `rules` is the parsed grammar."""

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
            kind, text = self._text()
            if len(text) > MAX_GRAMMAR_CHARS:
                raise InvalidField(FIELD, f"{given[0]} is {len(text)} characters; at most {MAX_GRAMMAR_CHARS}")
            self.rules = parse(kind, text)
            self.key = GrammarKey(kind, text, self.rules)
        except ImportError:
            raise InvalidField(FIELD, INSTALL_HINT) from None
        except (RuntimeError, TypeError, ValueError) as error:  # xgrammar's parse errors (json=5: a ValueError)
            if isinstance(error, InvalidField):
                raise
            problem = str(error).split(": ", 1)[-1].strip()  # without xgrammar's "[time] file.cc:line: " in front
            raise InvalidField(FIELD, f"{given[0]}: {problem}") from None

    def _text(self) -> tuple[str, str]:
        """(kind, text): a JSON schema's text, a regex, or an EBNF grammar (which the choices become)."""
        if self.choice is not None:
            if not isinstance(self.choice, list) or not all(isinstance(c, str) for c in self.choice):
                raise TypeError(f"{shown(self.choice)} is not a list of strings")
            # each choice as a string literal (EBNF's escapes are JSON's); no choices: an empty rule, refused
            return "grammar", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
        if self.regex is not None:
            return "regex", self.regex
        if self.grammar is not None:
            return "grammar", self.grammar
        if self.json is None and self.json_object is not True:  # json_object alone, but not True (1, "yes")
            raise TypeError(f"{shown(self.json_object)} is not a bool")
        if isinstance(self.json, str):
            return "json", self.json
        return "json", json.dumps({"type": "object"} if self.json is None else self.json)  # json_object: any object


def parse(kind: str, text: str) -> "xgrammar.Grammar":
    """A grammar's text, parsed by xgrammar. JSON is compact (no whitespace between tokens): a small model given any
    whitespace may emit it forever."""
    import xgrammar  # here first: later steps (attach, the background thread) find it imported

    if kind == "regex":
        return xgrammar.Grammar.from_regex(text)
    if kind == "grammar":
        return xgrammar.Grammar.from_ebnf(text)
    return xgrammar.Grammar.from_json_schema(text, any_whitespace=False)


def compile_grammar(tokenizer: "PreTrainedTokenizerBase", vocab_size: int, key: GrammarKey) -> object:
    """A grammar compiled for the model's vocabulary (which may be larger than the tokenizer's: the
    extra ids are never allowed), on the background thread: one compiler thread, leaving the step loop a core."""
    import xgrammar

    if tokenizer not in _compilers:
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        _compilers[tokenizer] = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    return _compilers[tokenizer].compile_grammar(key.rules)


def check_params(params: SamplingParams) -> None:
    """SamplingParams' structured_outputs as StructuredOutputsParams: one already, or a dict of its fields."""
    value = params.structured_outputs
    try:
        if not isinstance(value, StructuredOutputsParams):
            params.structured_outputs = StructuredOutputsParams(**value)
    except TypeError:  # not a dict, or a key that is no field
        raise InvalidField(FIELD, f"{shown(value)} is not StructuredOutputsParams or a dict of its fields") from None


class StructuredMatcher:
    """One sequence's place in its grammar: the mask of its next token, and the tokens it samples accepted."""

    def __init__(self, compiled: "xgrammar.CompiledGrammar", vocab_size: int, seq: Sequence) -> None:
        import xgrammar  # imported already: the request's params were made with it

        self.xgr = xgrammar
        # the grammar may end only on a token the engine stops on (None: the tokenizer's EOS, with ignore_eos)
        self.matcher = xgrammar.GrammarMatcher(compiled, override_stop_tokens=sorted(seq.stop_token_ids) or None)
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)  # [1, vocab / 32] int32, on the host
        self.vocab_size = vocab_size
        self.num_accepted = 0  # completion tokens the matcher has moved past
        # the ids the request may sample at all (allowed_token_ids), or None: any
        self.allowed = None
        if seq.params.allowed_token_ids is not None:
            self.allowed = torch.tensor(seq.params.allowed_token_ids)

    def catch_up(self, seq: Sequence) -> None:
        """Accept seq's completion tokens read back since the last call (the mask allowed each)."""
        for token_id in seq.completion_token_ids[self.num_accepted :]:
            if not self.matcher.accept_token(token_id):
                raise ValueError(f"the grammar does not allow the sampled token {token_id}")
        self.num_accepted = len(seq.completion_token_ids)

    def fill(self, seq: Sequence) -> str | None:
        """Make the mask of seq's next token; None, or why no token can be sampled: every token the grammar allows is
        outside allowed_token_ids, or a stop id that min_tokens bans. A finished grammar (its stop token sampled but
        ignored) allows every token."""
        self.bitmask.fill_(-1)  # every bit set
        if not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(self.bitmask)
        banned = set()  # what min_tokens bans of the next token (stopping.py's banned_token_ids, pending ones aside)
        if len(seq.completion_token_ids) < seq.params.min_tokens:
            banned = seq.stop_token_ids
        if self.allowed is None and not banned:  # the grammar always allows some token
            return None
        ids = self.allowed
        if ids is None:
            ids = torch.arange(self.vocab_size)
        allows = (self.bitmask[0, ids // 32] >> (ids % 32)) & 1 == 1  # [ids]: where the grammar allows the id
        if (allows & ~torch.isin(ids, torch.tensor(sorted(banned), dtype=ids.dtype))).any():
            return None
        if self.allowed is not None:
            return f"allowed_token_ids: the grammar of {FIELD} allows none of them here"
        return f"{FIELD}: the grammar allows only stop ids here, which min_tokens bans"

    def mask(self, logits: "Tensor") -> None:
        """logits: [vocab], one row on the device: every token the grammar does not allow next becomes -inf."""
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
    """The logits processor, and the admission rule that holds a constrained sequence until its grammar is compiled:
    the compiled grammars (Prepared: made beside the steps, kept by their text), and a matcher per admitted constrained
    sequence, forgotten once the sequence has finished (or, weakly keyed, once nothing holds it)."""

    def __init__(self, llm: "LLM") -> None:
        tokenizer = llm.tokenizer
        self.vocab_size = llm.vocab_size
        self.grammars = Prepared(
            llm,
            FIELD,
            lambda key: compile_grammar(tokenizer, self.vocab_size, key),
            grammar_key,
            KEEP_GRAMMARS,
            COMPILE_LIMIT_S,
        )
        self.matchers: weakref.WeakKeyDictionary[Sequence, StructuredMatcher] = weakref.WeakKeyDictionary()
        llm.scheduler.admission_rules.append(self.may_admit)  # after the grammars' own (Prepared: compiled yet?)

    def may_admit(self, seq: Sequence, running: list[Sequence]) -> bool:
        """The admission rule, after the grammars' (which holds a constrained sequence until its grammar is compiled,
        and ends its request if that failed or took too long): its matcher, unless its first mask leaves no token."""
        key = grammar_key(seq)
        if key is None or seq in self.matchers:  # unconstrained, or readmitted after a preemption
            return True
        matcher = StructuredMatcher(self.grammars.result(key), self.vocab_size, seq)
        problem = matcher.fill(seq)  # None, or why no token could be sampled: the request ends before any work
        if problem is not None:
            seq.error = problem
            return False
        self.matchers[seq] = matcher
        return True

    def needs_tokens_on_host(self) -> bool:
        return any(not seq.is_finished for seq in self.matchers)

    def prepare(self, seqs: list[Sequence]) -> StepMasks | None:
        """The step's constrained rows, each matcher caught up with its sequence's tokens and its mask made. A sequence
        whose matcher fails, or whose mask leaves no token it may sample, ends its request (Sequence.error)."""
        for seq in [s for s in self.matchers if s.is_finished]:
            del self.matchers[seq]
        rows = []
        for row, seq in enumerate(seqs):
            matcher = self.matchers.get(seq)
            if matcher is None:
                continue
            try:
                matcher.catch_up(seq)  # the tokens read back since its last mask
                problem = matcher.fill(seq)
            except Exception as error:
                problem = f"{FIELD}: {error}"
            if problem is None:
                rows.append((row, matcher))
            else:
                seq.error = problem
        return StepMasks(rows) if rows else None


def grammar_key(seq: Sequence) -> GrammarKey | None:
    """The name of seq's grammar, or None for an unconstrained sequence."""
    if seq.params.structured_outputs is None:
        return None
    return seq.params.structured_outputs.key


def attach(llm: "LLM", seqs: list[Sequence]) -> None:
    """A constrained request (its n samples): its grammar's compile starts beside the steps (or is found done); each
    sequence gets its matcher when it is admitted."""
    if llm.tokenizer is None:
        raise InvalidField(FIELD, "needs a tokenizer; this model has none")
    processor = llm.logits_processors.get(NAME)
    if processor is None:
        processor = llm.logits_processors[NAME] = StructuredOutputs(llm)
    processor.grammars.start(grammar_key(seqs[0]))
