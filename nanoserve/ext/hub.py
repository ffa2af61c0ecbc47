"""An extension: models from the Hugging Face hub. LLM("org/name") with no such folder here fetches the model's
config, weights, tokenizer and chat template (when online) into huggingface_hub's cache, and serves that folder."""

from nanoserve.checks import InvalidField

HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]  # config, weights, tokenizer, chat template


def download(model: str) -> str:
    """The local folder of hub id `model` ("org/name"), fetched if not cached yet; an InvalidField naming model when
    it cannot be (offline, or no such repository)."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, allow_patterns=HUB_FILES)
    except Exception as error:
        raise InvalidField("model", f"no such model directory: {model!r}, and not on the hub") from error
