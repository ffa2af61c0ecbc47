"""The extensions' registry: every idea beyond the core lives in a module (or a small folder) of nanoserve/ext/, and
this file is how the core finds one. The core never imports an extension by statement: when an option of LLM(...) or a
field of SamplingParams asks for an idea, the core asks `load` for its extension by name, and a deleted extension makes
that option an InvalidField naming it. An option left at the value that asks for nothing (vLLM's default) never loads
anything, so the core runs, and passes its tests, with every extension deleted.

The two tables say which option belongs to which extension. The extension points, each called once per request or once
per step, never per token:
- Options (EngineConfig.__post_init__, SamplingParams.__post_init__): an extension checks its own fields,
  `check_config(config)` or `check_params(params)`, raising InvalidField as the core's checks do.
- Engines (LLM, when it starts): `start(llm)` once per engine whose options use the extension (the step trace's
  writer; tensor parallelism's runner started before, with start_runner); what it returns is the extension's state
  for that engine, kept in LLM.extensions under its name.
- Requests (LLM.add_request): `attach(llm, seqs)` once per request that uses the extension, after the core's checks;
  it checks what needs the model (token ids against the vocabulary) and makes its logits processor if it has none yet.
- Logits processors (sampler.py's LogitsProcessor, in LLM.logits_processors): the runner asks each for its rows of
  every step, and the sampler applies them between the bans and the filters (ext/penalties.py, ext/structured.py).
- The step driver (LLM.run_step and LLM.receive_tokens): a loop of its own over the engine's steps, which branches
  sequences with Scheduler.fork (ext/beam_search.py).
- Kernels and projections (model.py's CausalLM.replace_kernels and wrap_projections), in start(): an extension may
  replace entries of the model's kernel table (ext/cascade.py: paged attention) or wrap its projections in modules
  of its own (ext/lora: each row's adapter; ext/latency: a weight read for few rows). The engine captures the decode
  graphs once, after every start() has run (ModelRunner.capture_graphs), so they replay what the eager forward runs.
- Layers and peers (layers.Layers, model_runner.Peers): how the model's weights are held and which other processes run
  each step (ext/tp: tensor parallelism).
- Steps, admission and the prefix cache (ModelRunner.step_hooks, Scheduler.admission_rules, Sequence.cache_salt): a
  callable the runner calls with every step before it runs (it may ask for the step to run eagerly, not as a graph
  replay: ext/cascade.py), a rule that holds the waiting queue, and a salt that keeps a sequence's blocks apart in the
  prefix cache (ext/lora: which rows use which adapter, at most max_loras adapters at once, blocks computed under
  one adapter never found under another). LLM.generate's (and chat's) lora_request asks
  ext/lora.py to attach each request's adapter (attach_adapters), checked before any request is queued.
- K/V that moves (Scheduler.kv_connector, BlockManager.on_evict, BlockManager.restore): a connector the scheduler
  asks, at admission, how many full blocks past the prefix cache's hits it can fill (booked as computed, filled before
  the step runs); a callback told of each cached block the pool evicts for new K/V; and a block so filled taking back
  its old prefix key, so that the blocks after it stay findable (ext/kv_offload.py: a host tier behind the prefix
  cache; ext/kv_transfer: prefill and decode on two engines).
- Outputs and failures (ModelRunner.output_hooks, Sequence.error): a callable the runner calls on rank 0 with each
  step's hidden states after the forward pass, which may return a finisher for the step's read-back
  (ext/prompt_logprobs.py; ext/kv_transfer's producer sends each completed prompt's blocks); and a sequence's error,
  set by an extension whose work on that sequence failed, which ends its request alone (finish reason "error").
- The speculative proposer and the step trace (LLM.proposer, LLM.trace), set by their extensions' start: the proposer
  drafts tokens before each step is planned (ext/speculative.py); the trace is told when each step begins and ends
  (ext/plots.py).
- Model families and weight formats (MODEL_TYPES, ModelArgs.extra_fields, ModelArgs.mlp, ModelArgs.checkpoint_places,
  ModelArgs.quantization): a config.json model_type in MODEL_TYPES makes ModelArgs.from_hf ask that extension's
  model_family() for a ModelArgs subclass (its fields, each layer's MLP, where each checkpoint tensor goes: ext/moe);
  EngineConfig.quantization, or a checkpoint's quantization_config, makes the loader ask ext/quantization's
  weight_format(config, hf_config, args) before any weight is read, whose Layers make the projections.
- Found by name, unasked (`find`): the fused Triton kernels whenever kernels="triton" (ext/fused_kernels.py, in
  kernels.get_kernels; without it the Triton backend is the core's attention and the references, run eagerly), vLLM's
  names (below), a CPU engine's threads (ext/cpu_threads.py).
- Named entry points the core calls when its option is set: the default model (model=None, ext/default_model.py), a
  hub id (ext/hub.py), the step trace (trace=PATH, ext/plots.py), tensor parallelism's runner (ext/tp),
  LLM.beam_search (ext/beam_search.py), LLM.chat (ext/chat.py), LLM.generate's lora_request (ext/lora's
  attach_adapters), a model family's model_family (ext/moe), a weight format's weight_format (ext/quantization).
- vLLM's names (ext/vllm_names.py): LLM(...) keywords go there first, if it is installed (`find`), where vLLM's are
  translated or refused by name; without it they are all unknown. vLLM's prompt dicts are unwrapped there too.
Applications of the engine are extensions too, which nothing in the core calls: the OpenAI server (ext/server)."""

import importlib
import numbers
from types import ModuleType

from nanoserve.checks import InvalidField

# An option that belongs to an extension -> (the extension, the value of the option that asks for nothing, or a tuple
# of such values)
Owners = dict[str, tuple[str, object]]
# LLM(...)'s options (EngineConfig's fields):
ENGINE_OPTIONS: Owners = {
    "tensor_parallel_size": ("tp", 1),
    "trace": ("plots", None),
    "speculative_config": ("speculative", None),
    "latency_kernels": ("latency", False),  # before lora: LoRA wraps the projections the GEMV wrapped
    "quantization": ("quantization", None),
    "kv_offloading_size": ("kv_offload", None),
    "kv_offloading_backend": ("kv_offload", None),
    "kv_transfer_config": ("kv_transfer", None),
    "lora_config": ("lora", None),
    "cascade_attention": ("cascade", False),  # last: it wraps the decode graphs that lora may capture again
}
# Model families an extension serves, by config.json's model_type (the core's own: llama, qwen2, qwen3)
MODEL_TYPES = {"qwen3_moe": "moe", "mixtral": "moe"}
# SamplingParams' fields:
REQUEST_FIELDS: Owners = {
    "n": ("parallel_sampling", 1),  # first: the other extensions attach to every sample's sequence
    "logit_bias": ("penalties", (None, {})),
    "repetition_penalty": ("penalties", 1.0),
    "presence_penalty": ("penalties", 0.0),
    "frequency_penalty": ("penalties", 0.0),
    "structured_outputs": ("structured", None),
    "allowed_token_ids": ("token_bans", None),
    "bad_words": ("token_bans", None),
    "prompt_logprobs": ("prompt_logprobs", None),
}


def asks_for_nothing(value: object, nothing: object) -> bool:
    """Whether an option's value asks nothing of its extension: it is the nothing-value (or one of a tuple of them),
    where a number equals any real number of the same value (1 as well as 1.0, but never a bool), and a dict equals a
    dict (logit_bias={})."""
    if isinstance(nothing, tuple):
        return any(asks_for_nothing(value, each) for each in nothing)
    if nothing is None or isinstance(nothing, bool):  # None, or a flag: only that very value (never 0 or 1)
        return value is nothing
    if isinstance(nothing, dict):
        return isinstance(value, dict) and value == nothing
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value == nothing


def extensions_asked(settings: object, owners: Owners) -> dict[str, str]:
    """{extension: the first of its options that asks for it} among settings' attributes named in owners (one of the
    tables above), in the table's order."""
    asked = {}
    for option, (name, nothing) in owners.items():
        if not asks_for_nothing(getattr(settings, option), nothing):
            asked.setdefault(name, option)
    return asked


def find(name: str) -> ModuleType | None:
    """The extension nanoserve.ext.<name>, imported on first use, or None where it is not installed: for the one the
    core consults without an option asking for it (vllm_names)."""
    try:
        return load(name, name)
    except InvalidField:
        return None


def load(name: str, option: str) -> ModuleType:
    """The extension nanoserve.ext.<name>, imported on first use. Where it is not installed (its file deleted), an
    InvalidField naming the option that asked for it."""
    module = f"{__name__}.{name}"
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name != module:  # the extension is there, but something it imports is not: its own error says what
            raise
        raise InvalidField(option, f"needs the extension {module}, which is not installed") from None
