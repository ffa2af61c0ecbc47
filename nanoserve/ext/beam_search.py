"""An extension: beam search, vLLM's LLM.beam_search, on sequences that share KV blocks: the one place where paging's
block sharing is more than a prefix cache. The prompt is computed once, by one sequence. After each step, every chosen
candidate forks the beam it extends: the fork shares all of its parent's blocks by reference count, the last, partial
one included, and the parent ends, freeing only the blocks no fork holds. Where several forks share a partial block,
each but the last to write its next token into it gets a copy of that one block first (copy-on-write, block_manager.py).
So k beams hold the prompt once, and their common history once.

The rule is transformers' `generate(num_beams=k, num_return_sequences=k, do_sample=False, length_penalty=lp,
early_stopping=False)`, step for step (its `_beam_search`). After each step, with L the tokens generated so far (the
new one included):
  1. Candidates: every beam extended by each token, scored by the sum of the generated tokens' logprobs
     (cum_logprob, no length penalty), ranked best first. Each beam offers its top k + (number of EOS ids) tokens,
     enough for k candidates that do not end in EOS (the sampler's logprobs: the model's own log-softmax, in fp32).
  2. Finished: of the k best candidates, each that ends in EOS (and, at L = max_tokens, every one of them) becomes a
     finished beam, ranked by cum_logprob / L ** length_penalty (L counts its EOS). An EOS candidate below the k best
     is dropped. The finished list keeps its k best.
  3. Running: the k best candidates that do not end in EOS are the next step's beams.
  4. Stop at max_tokens (capped at max_model_len), or once k beams have finished and the best running beam's
     cum_logprob / L ** length_penalty is no better than the worst finished one's (early_stopping=False's heuristic:
     it guesses that a running beam's score only falls from here; early_stopping=True would stop at k finished, and
     "never" with lp > 0 would divide by max_tokens ** lp instead).
The k finished beams are returned best first. Ties between equal scores are broken by order (beam, then the sampler's
top-N order), not necessarily as torch.topk breaks them in transformers; scores are summed in float64, transformers'
in float32, so a near-tie within float32's rounding may rank differently.

The driver runs one prompt at a time, through the engine's step driver (LLM.run_step: schedule, launch, read back,
finished by LLM.receive_tokens) without overlap, since each step's forks depend on the previous step's values. It needs
an idle engine: no other request in flight, so that every beam runs in every step. Before any work it checks that the
pool holds a prompt's search at its largest (the prompt's full blocks once, each beam's own blocks at max_tokens), so no
beam is ever preempted."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanoserve import ext
from nanoserve.checks import LISTS, InvalidField, Settings, check_numbers
from nanoserve.sampling_params import NUMBER_LIMITS, SamplingParams
from nanoserve.sequence import Sequence

if TYPE_CHECKING:
    from nanoserve.llm import LLM


MAX_LENGTH_PENALTY = 10.0  # any length to a power in [-10, 10] is a finite float64, never an OverflowError
# check_numbers' limits for BeamSearchParams' number fields: beam_width's are n's (a count, at least 1), max_tokens'
# are SamplingParams' own
BEAM_LIMITS = {
    "beam_width": NUMBER_LIMITS["n"],
    "max_tokens": NUMBER_LIMITS["max_tokens"],
    "temperature": {"low": 0, "high": 0},
    "length_penalty": {"low": -MAX_LENGTH_PENALTY, "high": MAX_LENGTH_PENALTY},
}


@dataclass
class BeamSearchParams(Settings):
    """vLLM's fields (importable from nanoserve.sampling_params too, where vLLM keeps it). temperature must be 0:
    nanoserve's beam search is deterministic."""

    beam_width: int  # beams kept, and sequences returned, per prompt
    max_tokens: int  # generated tokens at most, an EOS included
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0  # in [-10, 10]; finished beams rank by cum_logprob / generated_length ** this

    def __post_init__(self) -> None:
        check_numbers(self, BEAM_LIMITS)  # numbers stored back as plain ints or floats; ignore_eos a bool


@dataclass
class BeamSearchSequence:
    """One finished beam (vLLM's shape, less its logprobs and LoRA fields)."""

    tokens: list[int]  # the prompt, then the generated tokens (an EOS that ended the beam included)
    cum_logprob: float  # the generated tokens' logprobs, summed
    score: float  # what ranks the beams: cum_logprob / (generated tokens) ** length_penalty
    finish_reason: str  # "stop" (ended on EOS) or "length" (max_tokens or max_model_len)
    text: str = ""  # the generated tokens' text (an EOS's not shown); empty for a model without a tokenizer


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # beam_width of them, best first


def beam_search(
    llm: "LLM", prompts: list, params: BeamSearchParams, lora_request: object = None
) -> list[BeamSearchOutput]:
    """LLM.beam_search: each prompt's search in turn (prompts as generate takes them: text, ids, vLLM's dicts), after
    checking before any work: the prompts and params; an idle engine; beam_width within max_num_seqs and
    max_num_batched_tokens (every beam runs in every step) and the vocabulary; a pool that holds each search at its
    largest (Scheduler.check_fits), so that no beam is ever preempted; and lora_request (ext/lora: one LoRARequest,
    loaded and checked), which every prompt's first sequence runs under, and its forks."""
    if not isinstance(prompts, LISTS):
        raise InvalidField("prompts", "expected a list of prompts")
    if not isinstance(params, BeamSearchParams):
        raise InvalidField("params", f"expected BeamSearchParams, got {type(params).__name__}")
    # vLLM's prompt dicts as LLM.add_request takes them: by vLLM's names (ext/vllm_names.py)
    prompts = [ext.load("vllm_names", "prompt").unwrap_prompt(p) if isinstance(p, dict) else p for p in prompts]
    prompts = [llm.prompt_ids(prompt) for prompt in prompts]
    if llm.has_unfinished_requests():
        raise RuntimeError("beam_search needs an idle engine: finish or abort the requests in flight first")
    stop_ids = frozenset() if params.ignore_eos else llm.eos_token_ids
    k = params.beam_width
    if k > min(llm.config.max_num_seqs, llm.config.max_num_batched_tokens, llm.vocab_size - len(stop_ids)):
        raise InvalidField("beam_width", f"{k} beams do not fit one step (max_num_seqs, max_num_batched_tokens)")
    # each beam's next token comes with its top k + len(stop_ids) logprobs: k candidates that do not end in EOS. (The
    # driver, not the stop rules, ends beams: the sequences carry no stop ids.)
    sampling = SamplingParams(temperature=0, max_tokens=params.max_tokens, logprobs=k + len(stop_ids))
    firsts = [Sequence(prompt, sampling, llm.config.kvcache_block_size) for prompt in prompts]
    for seq in firsts:
        llm.scheduler.check_fits(seq, num_beams=k)
    if lora_request is not None:  # loaded and checked now (ext/lora)
        ext.load("lora", "lora_request").check_adapter(llm, lora_request)
    for seq in firsts:
        seq.cache_salt = lora_request  # its K/V's salt and its adapter (Scheduler.fork's copies keep it)
    return [search(llm, seq, params, stop_ids) for seq in firsts]


def search(llm: "LLM", first: Sequence, params: BeamSearchParams, stop_ids: frozenset[int]) -> BeamSearchOutput:
    """One prompt's search, from its first sequence (the rule is in the module's docstring); every beam's blocks are
    freed when it ends."""
    k = params.beam_width
    max_tokens = min(params.max_tokens, llm.config.max_model_len - first.num_prompt_tokens)
    scheduler = llm.scheduler
    scheduler.add(first)
    # the beams: (cum_logprob, its sequence), whose last token is the beam's newest, its K/V not computed yet
    beams = [(0.0, first)]
    finished = []
    try:
        for length in range(1, max_tokens + 1):  # tokens generated, once this step's are chosen
            # run steps until every beam has its next token's logprobs: one step, or a few while a long prompt prefills
            # in chunks. LLM.step's phases, without overlap: each step's forks depend on the previous step's values
            got = []
            while not got:
                got = llm.run_step(False, llm.receive_tokens)
            for seq, tokens, logprobs in got:  # one token each: beams have no draft tokens
                scheduler.resolve(seq, tokens[0], logprobs[0])
            sampled = [seq for seq, _, _ in got]
            # the pool was checked to hold every beam: none preempted, each in every step
            assert len(sampled) == len(beams), "a beam missed a step"
            # 1. (cum_logprob, the beam it extends, its next token); each beam's logprobs are popped: a fork copies no
            #    history of them
            candidates = sorted(
                ((cum + logprob, seq, token) for cum, seq in beams for token, logprob in seq.logprobs.pop().items()),
                key=lambda candidate: -candidate[0],
            )
            # 2. the k best that end here: (tokens, cum_logprob, score, finish_reason)
            finished += [
                BeamSearchSequence(
                    seq.token_ids[:-1] + [token],
                    cum,
                    cum / length**params.length_penalty,
                    "stop" if token in stop_ids else "length",
                )
                for cum, seq, token in candidates[:k]
                if token in stop_ids or length == max_tokens
            ]
            finished = sorted(finished, key=lambda beam: -beam.score)[:k]
            running = [c for c in candidates if c[2] not in stop_ids][:k]  # 3.
            if length == max_tokens or (
                len(finished) == k and running[0][0] / length**params.length_penalty <= finished[-1].score
            ):
                break  # 4.
            # the running candidates become the beams: each forks the beam it extends (sharing all its blocks) and
            # replaces the token the step sampled there (its argmax, whose K/V is not computed yet) with its own;
            # then the old beams end. Their blocks go back to the pool only where no fork holds them: a beam that one
            # candidate extends leaves its fork the sole holder (it writes in place), one that c candidates extend
            # leaves c holders of its partial block, c - 1 of which copy it when they write.
            parents = beams
            beams = []
            for cum, parent, token in running:
                seq = scheduler.fork(parent)  # a running sequence from the next step on
                seq.token_ids[-1] = token
                beams.append((cum, seq))
            for _, seq in parents:
                scheduler.finish_sequence(seq, "stop")
    finally:
        for _, seq in beams:
            scheduler.finish_sequence(seq, "stop")
    if llm.tokenizer is not None:
        for beam in finished:
            # the generated tokens less an EOS that ended the beam (no other generated token is one)
            generated = [t for t in beam.tokens[first.num_prompt_tokens :] if t not in stop_ids]
            beam.text = llm.tokenizer.decode(generated, skip_special_tokens=True)
    return BeamSearchOutput(finished)
