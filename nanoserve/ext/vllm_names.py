"""An extension: vLLM's own names for LLM(...) options that are not nanoserve's fields, and vLLM's prompt dicts, so
that code written for vLLM runs unchanged where it asks for nothing nanoserve lacks. EngineConfig.from_kwargs hands it
LLM(...)'s keywords (the core alone refuses every keyword that is not its own as unknown):
  - block_size is vLLM's name for kvcache_block_size (give one of the two);
  - trust_remote_code is accepted as False (nanoserve runs only its own model code), disable_log_stats as a bool
    (nanoserve logs no periodic stats);
  - enable_lora=True, with max_loras, max_lora_rank and max_cpu_loras, is nanoserve's lora_config (ext/lora.py: a
    dict of those sizes, which it checks), as vLLM makes its LoRAConfig of them; the sizes without enable_lora are
    taken at vLLM's defaults only;
  - every other option of vLLM's engine (VLLM_DEFAULTS) is accepted at vLLM's default value, which asks for nothing
    (swap_space=4, enable_chunked_prefill=True: nanoserve always chunks), and refused by name at
    any other value, as "a vLLM option that nanoserve does not implement";
  - anything else is left as it is, for the core to take or refuse as unknown.
And vLLM's prompt dicts, {"prompt": text} and {"prompt_token_ids": ids}, which LLM.generate, add_request and
beam_search hand it (unwrap_prompt): without this extension, a dict prompt is refused as "prompt"."""

from nanoserve.checks import InvalidField, check_flag, check_token_ids, shown
from nanoserve.ext import load

# vLLM's engine options that nanoserve does not implement -> the values that ask for nothing (vLLM's default; None,
# where vLLM's default is None or "chosen for you"). Equality decides: 4 and 4.0 are one value, but True is never 1.
VLLM_DEFAULTS = {
    "served_model_name": (None,),
    "hf_config_path": (None,),
    "task": ("auto", "generate"),
    "runner": ("auto", "generate"),
    "convert": ("auto", "none"),
    "skip_tokenizer_init": (False,),
    "enable_prompt_embeds": (False,),
    "tokenizer_mode": ("auto",),
    "allowed_local_media_path": ("",),
    "allowed_media_domains": (None,),
    "download_dir": (None,),
    "load_format": ("auto", "safetensors"),
    "config_format": ("auto", "hf"),
    "revision": (None,),
    "code_revision": (None,),
    "tokenizer_revision": (None,),
    "hf_token": (None,),
    "hf_overrides": (None, {}),
    "rope_scaling": (None, {}),
    "rope_theta": (None,),
    "quantization_param_path": (None,),
    "max_seq_len_to_capture": (8192,),
    "max_logprobs": (20,),
    "logprobs_mode": ("raw_logprobs",),
    "cuda_graph_sizes": (None, []),
    "compilation_config": (None,),
    "disable_custom_all_reduce": (False,),
    "distributed_executor_backend": (None,),
    "pipeline_parallel_size": (1,),
    "data_parallel_size": (1,),
    "data_parallel_size_local": (None,),
    "data_parallel_address": (None,),
    "data_parallel_rpc_port": (None,),
    "data_parallel_backend": ("mp",),
    "enable_expert_parallel": (False,),
    "enable_eplb": (False,),
    "max_parallel_loading_workers": (None,),
    "ray_workers_use_nsight": (False,),
    "worker_cls": ("auto",),
    "worker_extension_cls": ("",),
    "prefix_caching_hash_algo": ("sha256", "builtin"),
    "disable_sliding_window": (False,),
    "disable_cascade_attn": (False,),
    "swap_space": (4,),
    "cpu_offload_gb": (0,),
    "calculate_kv_scales": (False,),
    "num_gpu_blocks_override": (None,),
    "num_lookahead_slots": (0,),
    "max_num_partial_prefills": (1,),
    "max_long_partial_prefills": (1,),
    "long_prefill_token_threshold": (0,),
    "enable_chunked_prefill": (None, True),  # nanoserve always chunks long prompts
    "disable_chunked_mm_input": (False,),
    "scheduling_policy": ("fcfs",),
    "scheduler_cls": (None,),
    "scheduler_delay_factor": (0,),
    "preemption_mode": (None, "recompute"),  # nanoserve preempts by recompute
    "num_scheduler_steps": (1,),
    "multi_step_stream_outputs": (True,),
    "async_scheduling": (False,),
    "use_v2_block_manager": (True,),
    "enable_lora_bias": (False,),
    "lora_dtype": ("auto",),
    "lora_extra_vocab_size": (256,),
    "fully_sharded_loras": (False,),
    "long_lora_scaling_factors": (None,),
    "enable_prompt_adapter": (False,),
    "max_prompt_adapters": (1,),
    "max_prompt_adapter_token": (0,),
    "limit_mm_per_prompt": (None, {}),
    "mm_processor_kwargs": (None, {}),
    "mm_processor_cache_gb": (4,),
    "disable_mm_preprocessor_cache": (False,),
    "guided_decoding_backend": ("auto", "xgrammar"),  # the grammar engine nanoserve uses
    "structured_outputs_config": (None,),
    "reasoning_parser": ("",),
    "logits_processors": (None, []),
    "logits_processor_pattern": (None,),
    "disable_async_output_proc": (False,),
    "override_neuron_config": (None, {}),
    "override_pooler_config": (None,),
    "pooler_config": (None,),
    "override_generation_config": (None, {}),
    "generation_config": ("auto",),
    "model_impl": ("auto",),
    "enable_sleep_mode": (False,),
    "kv_events_config": (None,),
    "additional_config": (None, {}),
    "qlora_adapter_name_or_path": (None,),
    "otlp_traces_endpoint": (None,),
    "collect_detailed_traces": (None,),
    "show_hidden_metrics_for_version": (None,),
    "use_tqdm_on_load": (True,),
    "pt_load_map_location": ("cpu",),
    "model_loader_extra_config": (None, {}),
    "ignore_patterns": (None,),
    "tokenizer_pool_size": (0,),
    "tokenizer_pool_type": ("ray",),
    "tokenizer_pool_extra_config": (None,),
}
LORA_SIZES = {"max_loras": (1,), "max_lora_rank": (16,), "max_cpu_loras": (None,)}  # vLLM's LoRA sizes, its defaults


def asks_for_nothing(value: object, defaults: tuple) -> bool:
    """value is one of defaults: equal and of the same kind (a bool is not taken for 0 or 1, nor 1 for True)."""
    return any(value == d and isinstance(value, bool) == isinstance(d, bool) for d in defaults)


def engine_kwargs(kwargs: dict[str, object]) -> dict[str, object]:
    """LLM(...)'s keywords with vLLM's names translated or dropped (see the module's docstring); a vLLM option that
    asks for something nanoserve lacks is an InvalidField naming it. Other keywords are left for the core."""
    kwargs = dict(kwargs)
    if "block_size" in kwargs:
        if "kvcache_block_size" in kwargs:
            raise InvalidField("block_size", "vLLM's name for kvcache_block_size: give one of the two")
        kwargs["kvcache_block_size"] = kwargs.pop("block_size")
    check_flag("disable_log_stats", kwargs.pop("disable_log_stats", False))
    if "disable_cascade_attn" in kwargs:  # vLLM's: False lets it use cascade attention where it pays, as ours does
        if "cascade_attention" in kwargs:
            raise InvalidField("disable_cascade_attn", "vLLM's name for cascade_attention: give one of the two")
        disable = kwargs.pop("disable_cascade_attn")
        check_flag("disable_cascade_attn", disable)
        kwargs["cascade_attention"] = not disable
    if kwargs.pop("trust_remote_code", False) is not False:
        raise InvalidField("trust_remote_code", "only False: nanoserve runs only its own model code (Llama, Qwen)")
    lora_sizes = {name: kwargs.pop(name) for name in LORA_SIZES if name in kwargs}
    enable_lora = kwargs.pop("enable_lora", False)
    check_flag("enable_lora", enable_lora)
    for name, value in lora_sizes.items():  # without enable_lora, only vLLM's defaults: they ask for nothing
        if not enable_lora and not asks_for_nothing(value, LORA_SIZES[name]):
            raise InvalidField(name, f"{shown(value)} needs enable_lora=True")
    if enable_lora and "lora_config" in kwargs:
        raise InvalidField("enable_lora", "vLLM's name for lora_config: give one of the two")
    if enable_lora:
        load("lora", "enable_lora")  # refused by this name where the extension is not installed
        kwargs["lora_config"] = lora_sizes
    for name in sorted(set(kwargs) & set(VLLM_DEFAULTS)):
        value = kwargs.pop(name)
        if not asks_for_nothing(value, VLLM_DEFAULTS[name]):
            defaults = " or ".join(map(shown, VLLM_DEFAULTS[name]))
            raise InvalidField(name, f"a vLLM option that nanoserve does not implement (only {defaults} is taken)")
    return kwargs


def unwrap_prompt(prompt: dict) -> object:
    """A vLLM prompt dict as what it holds: {"prompt": text} as the text, {"prompt_token_ids": ids} as the ids. Other
    keys (vLLM's multi_modal_data, cache_salt, ...) are refused by name."""
    if len(prompt) == 1 and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    if len(prompt) == 1 and "prompt_token_ids" in prompt:
        return check_token_ids("prompt_token_ids", prompt["prompt_token_ids"])
    keys = ", ".join(map(shown, prompt))
    raise InvalidField("prompt", f"a prompt dict takes 'prompt' (text) or 'prompt_token_ids' (ids), one: not {keys}")
